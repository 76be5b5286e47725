"""decode-1 on llama.cpp (llama-cpp-python), run by the llama peer's own Python.

Loads a GGUF file as shipped, warms up with one full decode, prints a ``PEER_READY`` line,
then for every line read on stdin decodes the prompt once and prints one
``PEER_RESULT {json}`` line: TTFT (prefill of the prompt + the first token), per-token decode
time, tokens/s (new tokens / (TTFT + decode)) and the generated ids. Greedy through
``llm.eval`` and the argmax of the last logits (not llama.cpp's sampler); EOS is ignored.
It does not import kvserve; benchmarks/decode.py drives it, alternating with kvserve:

    printf 'run\\n' | .peers/llama/bin/python benchmarks/peers/llama_decode.py \\
        --model MODEL.gguf --prompt-ids '[1, 2, 3]' [--new-tokens 128] [--threads 2] \\
        [--no-extra-bufts]

``--no-extra-bufts`` loads the weights without llama.cpp's extra buffer types (the AMX and
CPU-repack weight layouts). llama-cpp-python 0.3.36 built natively on an AMX Xeon segfaults
in ``ggml_backend_amx_mul_mat`` on its first prompt of more than one token (llama.cpp issue
20824); benchmarks/decode.py retries with this flag when the peer dies that way, and says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import llama_cpp
import llama_cpp.llama_cpp as llama_capi
import numpy as np
from llama_cpp import Llama


def last_logits(llm: Llama) -> np.ndarray:
    """The logits of the last token evaluated (with logits_all=False, ``llm.scores`` is not
    filled: read them from the context)."""
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))


def decode(llm: Llama, prompt: list[int], new_tokens: int) -> dict:
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    ids = [int(last_logits(llm).argmax())]
    t1 = time.perf_counter()
    for _ in range(new_tokens - 1):
        llm.eval([ids[-1]])
        ids.append(int(last_logits(llm).argmax()))
    t2 = time.perf_counter()
    ttft, dec = t1 - t0, t2 - t1
    return {
        "ttft_s": ttft,
        "decode_s": dec,
        "tpot_s": dec / max(new_tokens - 1, 1),
        "tokens_per_s": new_tokens / (ttft + dec),
        "token_ids": ids,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="GGUF file")
    ap.add_argument("--prompt-ids", required=True, help="JSON list of prompt token ids")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-extra-bufts", action="store_true", help="no AMX / repack buffers")
    args = ap.parse_args()
    prompt = json.loads(args.prompt_ids)
    if args.no_extra_bufts:
        # Llama() takes no such argument: it reads the defaults through this function
        defaults = llama_capi.llama_model_default_params

        def without_extra_bufts():
            params = defaults()
            params.use_extra_bufts = False
            return params

        llama_capi.llama_model_default_params = without_extra_bufts

    llm = Llama(
        model_path=args.model,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_ctx=1024,
        n_batch=512,
        verbose=False,
    )
    decode(llm, prompt, args.new_tokens)  # warm-up
    ready = {"llama_cpp_python": llama_cpp.__version__, "extra_bufts": not args.no_extra_bufts}
    print("PEER_READY " + json.dumps(ready), flush=True)
    for _ in sys.stdin:
        print("PEER_RESULT " + json.dumps(decode(llm, prompt, args.new_tokens)), flush=True)


if __name__ == "__main__":
    main()
