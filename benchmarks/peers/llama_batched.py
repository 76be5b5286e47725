"""Batched decode on llama.cpp (llama-cpp-python's low-level API), run by the llama peer's own
Python.

B sequences, each with its own prompt (``--prompt-ids``: a JSON list of B lists of token ids),
in one context with ``n_seq_max=B``: every prompt is prefilled in one ``llama_decode`` (llama.cpp
cuts it into ``n_ubatch`` pieces itself), then each of the ``new - 1`` decode steps is ONE
``llama_decode`` of B tokens, one per sequence (its own ``seq_id``, a logit row each), greedy
by the argmax of ``llama_get_logits_ith`` per sequence (not llama.cpp's sampler); EOS is
ignored. That is ``llama-batched-bench``'s generation phase with distinct prompts. Loads the
GGUF as shipped, warms up with one whole run, prints a ``PEER_READY`` line, then for every
line read on stdin runs once and prints one ``PEER_RESULT {json}`` line: prefill time (all B
prompts and their first tokens), decode time, aggregate decode tok/s = B * (new - 1) / decode
time, and the ids per sequence. It does not import kvserve; benchmarks/decode_batch.py drives
it, alternating with kvserve:

    printf 'run\\n' | .peers/llama/bin/python benchmarks/peers/llama_batched.py \\
        --model MODEL.gguf --prompt-ids '[[1, 2, 3], [4, 5, 6]]' [--new-tokens 64] \\
        [--threads 2] [--no-extra-bufts]

``--no-extra-bufts``: the weights without llama.cpp's extra buffer types (AMX and CPU-repack
layouts), as in peers/llama_decode.py (llama-cpp-python 0.3.36 built on an AMX Xeon segfaults
in ``ggml_backend_amx_mul_mat`` on its first prompt of more than one token, llama.cpp issue
20824); benchmarks/decode_batch.py retries with it when the peer dies by a signal.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import llama_cpp
import numpy as np

N_UBATCH = 512  # llama.cpp's default micro-batch: the compute buffer stays that of 512 rows


def fill(batch: llama_cpp.llama_batch, rows: list[tuple[int, int, int, bool]]) -> None:
    """Write (token, position, seq_id, wants logits) rows into a llama_batch from
    llama_batch_init (every token in exactly one sequence)."""
    for i, (token, pos, seq, logits) in enumerate(rows):
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits
    batch.n_tokens = len(rows)


def argmax_rows(ctx: llama_cpp.llama_context_p, rows: list[int], n_vocab: int) -> list[int]:
    """Greedy token of each batch row in ``rows`` (rows that asked for logits)."""
    out = []
    for i in rows:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
        out.append(int(logits.argmax()))
    return out


def decode_or_raise(ctx: llama_cpp.llama_context_p, batch: llama_cpp.llama_batch) -> None:
    rc = llama_cpp.llama_decode(ctx, batch)
    if rc != 0:  # 1: no KV slot (context too small); < 0: invalid batch or fatal
        raise RuntimeError(f"llama_decode returned {rc} for a batch of {batch.n_tokens} tokens")


def run(
    ctx: llama_cpp.llama_context_p,
    batch: llama_cpp.llama_batch,
    prompts: list[list[int]],
    new_tokens: int,
    n_vocab: int,
) -> dict:
    """One batched generation from an empty KV cache."""
    # metadata and data: a run never sees the previous run's cells
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    b = len(prompts)
    t0 = time.perf_counter()
    # prefill: every prompt token at its position in its own sequence, a logit row for each
    # prompt's last token only; llama_get_logits_ith takes the batch row index
    rows = [
        (tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)
    ]
    fill(batch, rows)
    decode_or_raise(ctx, batch)
    last_rows = [i for i, r in enumerate(rows) if r[3]]  # in sequence order
    ids = [[t] for t in argmax_rows(ctx, last_rows, n_vocab)]
    t1 = time.perf_counter()
    for step in range(new_tokens - 1):
        # one llama_decode of B tokens: sequence s's last token at position len(prompt) + step
        fill(batch, [(ids[s][-1], len(prompts[s]) + step, s, True) for s in range(b)])
        decode_or_raise(ctx, batch)
        for s, t in enumerate(argmax_rows(ctx, list(range(b)), n_vocab)):
            ids[s].append(t)
    t2 = time.perf_counter()
    prefill, dec = t1 - t0, t2 - t1
    return {
        "prefill_s": prefill,
        "decode_s": dec,
        "tpot_s": dec / max(new_tokens - 1, 1),
        "decode_tokens_per_s": b * (new_tokens - 1) / dec if dec > 0 else 0.0,
        "token_ids": ids,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="GGUF file")
    ap.add_argument("--prompt-ids", required=True, help="JSON list of B lists of token ids")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-extra-bufts", action="store_true", help="no AMX / repack buffers")
    args = ap.parse_args()
    prompts: list[list[int]] = json.loads(args.prompt_ids)
    b, total = len(prompts), sum(len(p) for p in prompts)
    longest = max(len(p) for p in prompts) + args.new_tokens

    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.use_extra_bufts = not args.no_extra_bufts
    model = llama_cpp.llama_model_load_from_file(args.model.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {args.model}")
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))

    cparams = llama_cpp.llama_context_default_params()
    # kv_unified stays llama.cpp's default (False): one KV stream of n_ctx / n_seq_max cells
    # per sequence, so each needs room for its prompt + new tokens
    cparams.n_seq_max = b
    cparams.n_ctx = b * longest
    cparams.n_batch = max(total, b)  # all prompts in one llama_decode, and B decode rows
    cparams.n_ubatch = min(N_UBATCH, cparams.n_batch)
    # a logit row per sequence per call (the default n_outputs_max = n_batch would reserve
    # n_batch x n_vocab floats of output buffer for rows never asked for)
    cparams.n_outputs_max = b
    cparams.n_threads = args.threads
    cparams.n_threads_batch = args.threads
    cparams.no_perf = True
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError(f"llama.cpp could not make a context of {cparams.n_ctx} tokens")
    n_ctx = llama_cpp.llama_n_ctx(ctx)
    if n_ctx < b * longest:
        raise RuntimeError(f"context of {n_ctx} tokens, {b} x {longest} needed")
    batch = llama_cpp.llama_batch_init(cparams.n_batch, 0, 1)

    run(ctx, batch, prompts, args.new_tokens, n_vocab)  # warm-up
    ready = {
        "llama_cpp_python": llama_cpp.__version__,
        "extra_bufts": not args.no_extra_bufts,
        "n_ctx": n_ctx,
        "n_batch": cparams.n_batch,
        "n_ubatch": cparams.n_ubatch,
        "kv_unified": bool(cparams.kv_unified),
        "flash_attn_type": int(cparams.flash_attn_type),
    }
    print("PEER_READY " + json.dumps(ready), flush=True)
    for _ in sys.stdin:
        result = run(ctx, batch, prompts, args.new_tokens, n_vocab)
        print("PEER_RESULT " + json.dumps(result), flush=True)
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)


if __name__ == "__main__":
    main()
