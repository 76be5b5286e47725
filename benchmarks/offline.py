"""offline-64 (../shared/docs/BENCHMARKS.md): 64 requests, prompt lengths uniform in [32, 512],
output lengths uniform in [32, 256], ignore EOS, all submitted at once. kvserve's paged engine
vs HF transformers batched generate with its static cache, same model, dtype and prompts,
alternating; output tokens/s and the ratio.

HF generates a padded batch until its longest request is done; it is credited only with the
tokens each request asked for (the same useful work kvserve does).

    python benchmarks/offline.py [--dtype bfloat16] [--num-requests 64] [--runs 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks.common import export_hf_dir_model, kvserve_llm, workload_offline
from kvserve.sampling import SamplingParams


def run_hf(model, prompts: list[list[int]], outputs: list[int], batch_size: int) -> float:
    """Seconds for HF generate over all prompts, in batches of ``batch_size`` (left padded)."""
    start = time.perf_counter()
    for lo in range(0, len(prompts), batch_size):
        ps, os_ = prompts[lo : lo + batch_size], outputs[lo : lo + batch_size]
        width = max(len(p) for p in ps)
        ids = torch.zeros((len(ps), width), dtype=torch.long)
        mask = torch.zeros((len(ps), width), dtype=torch.long)
        for i, p in enumerate(ps):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        new = max(os_)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                cache_implementation="static",
                pad_token_id=0,
            )
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    llm = kvserve_llm(args.model, args.dtype, max_num_seqs=args.max_num_seqs)
    prompts, outputs = workload_offline(args.num_requests, llm.session.config.vocab_size)
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outputs]
    useful = sum(outputs)
    hf = None if args.skip_hf else export_hf_dir_model(llm.session, llm.session.model.dtype)

    times: dict[str, list[float]] = {"kvserve": [], "hf-static": []}
    for run in range(args.runs):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times["kvserve"].append(time.perf_counter() - t)
        assert sum(len(o.token_ids) for o in outs) == useful
        if hf is not None:
            times["hf-static"].append(run_hf(hf, prompts, outputs, args.hf_batch_size))
        print(f"run {run + 1}/{args.runs} done", file=sys.stderr)

    stats = llm.engine.stats()
    print(
        f"offline-{args.num_requests}: model={llm.session.path.name} dtype={args.dtype} "
        f"threads={args.threads} output tokens={useful} prompt tokens={sum(map(len, prompts))} "
        f"runs={args.runs} torch={torch.__version__} preemptions={stats.num_preemptions}"
    )
    rates = {}
    for name, ts in times.items():
        if ts:
            med = statistics.median(ts)
            rates[name] = useful / med
            print(f"{name:<12} {med:8.1f} s  {useful / med:8.1f} output tok/s")
    if "hf-static" in rates:
        print(f"ratio kvserve / hf-static: {rates['kvserve'] / rates['hf-static']:.2f}x")


if __name__ == "__main__":
    main()
