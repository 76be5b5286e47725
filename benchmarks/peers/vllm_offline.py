"""offline-64 on vLLM CPU (shared/docs/BENCHMARKS.md), run by the vLLM peer's own Python.

Loads an HF directory (``--dtype``, float32 by default), warms up with one short generate (the first
``--warmup-requests`` prompts, 8 tokens each), prints a
``PEER_READY`` line, then for every line read on stdin runs the workload once (all requests
in one ``generate`` call, greedy, EOS ignored, each request its own output length) and prints
one ``PEER_RESULT {json}`` line: output tokens, seconds, output tokens/s. Only the generate
call is timed. The environment follows shared/docs/PEERS.md (set here unless already set).
It does not import kvserve; benchmarks/offline.py drives it, alternating with kvserve:

    printf 'run\\n' | .peers/vllm/bin/python benchmarks/peers/vllm_offline.py \\
        --model .peers/smollm2-hf --workload WORKLOAD.json [--threads 2]

WORKLOAD.json: ``{"prompts": [[token ids], ...], "outputs": [output length, ...]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path(__file__).resolve().parents[2] / ".peers"))


def set_environment(threads: int) -> None:
    env = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CACHE_ROOT": str(PEERS_DIR / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(PEERS_DIR / "inductor-cache"),
    }
    for key, value in env.items():
        os.environ.setdefault(key, value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF directory (float32)")
    ap.add_argument("--workload", required=True, help="JSON file: prompts (token ids), outputs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--warmup-requests", type=int, default=8)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    set_environment(args.threads)

    import vllm  # after the environment is set
    from vllm import LLM, SamplingParams

    try:
        from vllm.inputs import TokensPrompt
    except ImportError:
        from vllm import TokensPrompt

    work = json.loads(Path(args.workload).read_text())
    prompts = [TokensPrompt(prompt_token_ids=p) for p in work["prompts"]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in work["outputs"]]
    expected = sum(work["outputs"])

    # no prefix caching: every run repeats the same prompts, and a hit is not the workload
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=0,
        enable_prefix_caching=False,
    )

    def run_once(prompts, params) -> dict:
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}

    # warm-up: the first requests, a few tokens each (the first generate compiles)
    n = min(args.warmup_requests, len(prompts))
    warm = run_once(prompts[:n], [SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)] * n)
    ready = {"vllm": vllm.__version__, "dtype": args.dtype, "warmup": warm}
    print("PEER_READY " + json.dumps(ready), flush=True)
    for _ in sys.stdin:
        result = run_once(prompts, params)
        if result["output_tokens"] != expected:
            raise RuntimeError(f"vLLM generated {result['output_tokens']}, expected {expected}")
        print("PEER_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
