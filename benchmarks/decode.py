"""decode-1 (../shared/docs/BENCHMARKS.md): one request, 128-token prompt, 128 new tokens, greedy,
ignore EOS. kvserve's paged engine, its dense-cache and no-cache reference decoders, and HF
transformers (static cache) on the same
model and dtype, alternating in the same run; prints medians and ratios, and the decode step's
bytes read per second against this machine's measured memory bandwidth.

    python -m benchmarks.decode [--model PATH] [--dtype bfloat16] [--runs 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks.common import export_hf_dir_model, measure_bandwidth
from kvserve.engine.llm import LLM
from kvserve.generation import generate
from kvserve.kv.spec import KVCacheSpec
from kvserve.models.packed_linear import dense_state_dict
from kvserve.reference import DenseCacheDecoder, NoCacheDecoder
from kvserve.sampling import SamplingParams
from kvserve.session import ModelSession


def run_hf(model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(time to first token, total time) of HF generate with its static cache."""
    ids = torch.tensor([prompt])
    common = dict(do_sample=False, cache_implementation="static", pad_token_id=0)
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **common)
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **common)
        total = time.perf_counter() - t
    assert out.shape[1] == len(prompt) + new_tokens
    return ttft, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-no-cache", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    session = ModelSession.open(args.model, args.dtype)
    model, cfg = session.model, session.config
    hf = export_hf_dir_model(session, model.dtype)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    max_len = args.prompt_len + args.new_tokens

    llm = LLM(session=session, max_num_seqs=1)
    rows: dict[str, list[tuple[float, float]]] = {
        "kvserve-engine": [],
        "kvserve-dense": [],
        "kvserve-no-cache": [],
        "hf-static": [],
    }
    for run in range(args.runs):  # alternate engines within each run
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        rows["kvserve-engine"].append((out.ttft_s, out.ttft_s + out.decode_time_s))
        r = generate(DenseCacheDecoder(model, max_len), prompt, params)
        rows["kvserve-dense"].append((r.ttft_s, r.ttft_s + r.decode_s))
        if not args.skip_no_cache:
            r = generate(NoCacheDecoder(model), prompt, params)
            rows["kvserve-no-cache"].append((r.ttft_s, r.ttft_s + r.decode_s))
        rows["hf-static"].append(run_hf(hf, prompt, args.new_tokens))
        print(f"run {run + 1}/{args.runs} done", file=sys.stderr)

    bw = measure_bandwidth()
    # a step reads every weight once, except the embedding table (one row per token)
    weight_bytes = sum(
        t.nbytes for k, t in dense_state_dict(model).items() if k != "model.embed_tokens.weight"
    )
    kv_row_bytes = KVCacheSpec.for_model(cfg, model.dtype).bytes_per_token
    avg_ctx = args.prompt_len + args.new_tokens / 2
    step_bytes = weight_bytes + kv_row_bytes * avg_ctx

    print(
        f"decode-1: model={session.path.name} dtype={args.dtype} threads={args.threads} "
        f"prompt={args.prompt_len} new={args.new_tokens} runs={args.runs} torch={torch.__version__}"
    )
    print(f"{'engine':<18}{'tok/s':>8}{'TTFT ms':>9}{'TPOT ms':>9}{'GB/s':>7}{'of BW':>7}")
    results = {}
    for name, vals in rows.items():
        if not vals:
            continue
        ttft = statistics.median(v[0] for v in vals)
        total = statistics.median(v[1] for v in vals)
        tpot = (total - ttft) / (args.new_tokens - 1)
        tps = args.new_tokens / total
        results[name] = tps
        gbs = step_bytes / tpot / 1e9
        print(
            f"{name:<18}{tps:>8.1f}{ttft * 1e3:>9.1f}{tpot * 1e3:>9.2f}{gbs:>7.1f}{gbs / bw:>7.0%}"
        )
    print(
        f"memory bandwidth (sum of 1 GiB float32, {args.threads} threads): {bw:.1f} GB/s; "
        f"decode step reads ~{step_bytes / 1e6:.0f} MB (weights + mean live KV)"
    )
    base = results["hf-static"]
    for name, tps in results.items():
        if name != "hf-static":
            print(f"ratio {name} / hf-static: {tps / base:.2f}x")


if __name__ == "__main__":
    main()
