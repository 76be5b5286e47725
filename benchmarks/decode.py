"""decode-1 (shared/docs/BENCHMARKS.md): one request, 128-token prompt, 128 new tokens, greedy,
ignore EOS. kvserve's paged engine, its dense-cache and no-cache reference decoders, HF
transformers (static cache, on kvserve's loaded weights made dense) and llama.cpp
(llama-cpp-python in its own venv, on the same GGUF file as shipped) with the same prompt
token ids, alternating within each run; prints medians of ``--runs``, the ratios kvserve /
llama.cpp and kvserve / HF for tokens/s and TTFT, and the bytes a kvserve decode step reads
(resident weights + the mean live KV) per step time against the memory bandwidth measured in
the same run.

    python -m benchmarks.decode [--model PATH] [--dtype auto] [--runs 3] [--threads 2] \\
        [--llama-python .peers/llama/bin/python] [--skip-no-cache] [--skip-hf]

The llama.cpp peer is installed by ``bash benchmarks/peers/setup.sh llama``; without it (or
for a model that is not a GGUF file) that row is left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import plot
from benchmarks.common import (
    default_peer_python,
    export_hf_dir_model,
    measure_bandwidth,
    resident_weight_bytes,
    start_llama_peer,
    with_dtype_fallback,
)
from kvserve.engine.llm import LLM
from kvserve.models.model_session import ModelSession
from kvserve.reference.decoders import DenseCacheDecoder, NoCacheDecoder
from kvserve.reference.generation import generate
from kvserve.sampling import SamplingParams


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


def gguf_file(path: Path) -> Path | None:
    """The GGUF file llama.cpp can load for this model, if there is one."""
    if path.suffix == ".gguf":
        return path
    found = sorted(path.glob("*.gguf")) if path.is_dir() else []
    return found[0] if len(found) == 1 else None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def draw(
    path, title: str, tps: dict[str, float], ttfts: dict[str, float], bw_share: dict[str, float]
) -> None:
    """tok/s and TTFT per engine; kvserve's rows annotated with their ratio to the peers (and
    the share of the measured memory bandwidth a step reads)."""
    names = list(tps)
    peers = [p for p in ("llama.cpp", "hf-static") if p in tps]

    def notes(values: dict[str, float], ratio: dict[str, float], bw: bool) -> list[str]:
        """Each bar's value; kvserve's also ratio[kvserve] / ratio[peer] per peer."""
        out = []
        for n in names:
            lines = [f"{values[n]:.1f}"]
            if n.startswith("kvserve"):
                lines += [f"{ratio[n] / ratio[p]:.2f}x {p}" for p in peers]
                if bw and n in bw_share:
                    lines.append(f"{bw_share[n]:.0%} of BW")
            out.append("\n".join(lines))
        return out

    plot.figure(
        path,
        title,
        [
            plot.Bars(
                names,
                [tps[n] for n in names],
                "output tokens/s (median)",
                notes(tps, tps, bw=True),
                title="decode throughput (higher is faster; ratio: kvserve / peer)",
                xlabel="engine",
            ),
            plot.Bars(
                names,
                [1e3 * ttfts[n] for n in names],
                "time to first token (ms, median)",
                notes({n: 1e3 * v for n, v in ttfts.items()}, ttfts, bw=False),
                title="TTFT (lower is faster; ratio: kvserve / peer)",
                xlabel="engine",
            ),
        ],
    )


def start_llama(python: str, gguf, prompt: list[int], new_tokens: int, threads: int):
    """The llama.cpp peer, ready (retried without extra buffer types if it crashes)."""
    args = ["--model", str(gguf), "--prompt-ids", json.dumps(prompt)]
    args += ["--new-tokens", str(new_tokens), "--threads", str(threads)]
    return start_llama_peer(python, "llama_decode.py", args)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: embedded)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-no-cache", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--llama-python",
        default=default_peer_python("llama"),
        help="Python of the llama-cpp-python venv (default: .peers/llama/bin/python if set up)",
    )
    ap.add_argument(
        "--batch-invariant",
        action="store_true",
        help="kvserve in batch-invariant mode (the same bits whatever the batch or chunking)",
    )
    plot.add_plot_arg(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    session, dtype = with_dtype_fallback(lambda d: ModelSession.open(args.model, d), args.dtype)
    model, cfg = session.model, session.config
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    max_len = args.prompt_len + args.new_tokens
    # HF computes in the dtype kvserve computes in: float32 unless bfloat16 was asked for
    hf_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    hf = None if args.skip_hf else export_hf_dir_model(session, hf_dtype)

    # no prefix caching: every run repeats the prompt, and a hit would make TTFT a lookup
    extra = {"batch_invariant": True} if args.batch_invariant else {}
    llm = LLM(session=session, max_num_seqs=1, enable_prefix_caching=False, **extra)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], warm, use_tqdm=False)
    generate(DenseCacheDecoder(model, max_len), prompt, warm)

    llama = None
    gguf = gguf_file(session.path)
    if args.llama_python and gguf is not None:
        llama = start_llama(args.llama_python, gguf, prompt, args.new_tokens, args.threads)
    elif args.llama_python is None:
        print("llama.cpp: not set up (bash benchmarks/peers/setup.sh llama)", file=sys.stderr)
    else:
        print(f"llama.cpp: {session.path} is not a GGUF file; left out", file=sys.stderr)

    rows: dict[str, list[tuple[float, float]]] = {
        "kvserve-engine": [],
        "kvserve-dense": [],
        "kvserve-no-cache": [],
        "hf-static": [],
        "llama.cpp": [],
    }
    kvserve_ids: list[int] = []
    llama_ids: list[int] = []
    for run in range(args.runs):  # alternate engines within each run
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        rows["kvserve-engine"].append((out.ttft_s, out.ttft_s + out.decode_time_s))
        kvserve_ids = list(out.token_ids)
        r = generate(DenseCacheDecoder(model, max_len), prompt, params)
        rows["kvserve-dense"].append((r.ttft_s, r.ttft_s + r.decode_s))
        if not args.skip_no_cache:
            r = generate(NoCacheDecoder(model), prompt, params)
            rows["kvserve-no-cache"].append((r.ttft_s, r.ttft_s + r.decode_s))
        if hf is not None:
            rows["hf-static"].append(run_hf(hf, prompt, args.new_tokens))
        if llama is not None:
            res = llama.run()
            rows["llama.cpp"].append((res["ttft_s"], res["ttft_s"] + res["decode_s"]))
            llama_ids = res["token_ids"]
        print(f"run {run + 1}/{args.runs} done", file=sys.stderr)
    llama_info = llama.info if llama is not None else {}
    if llama is not None:
        llama.close()

    bw = measure_bandwidth()
    weight_bytes, embedding_bytes = resident_weight_bytes(model)
    kv_row_bytes = llm.engine.spec.bytes_per_token
    avg_ctx = args.prompt_len + args.new_tokens / 2
    step_bytes = weight_bytes + kv_row_bytes * avg_ctx

    versions = f"torch={torch.__version__}"
    if llama_info:
        versions += f" llama-cpp-python={llama_info['llama_cpp_python']}"
        if not llama_info.get("extra_bufts", True):
            versions += " (no AMX/repack buffers: it crashed with them)"
    title = (
        f"decode-1: model={session.path.name} dtype={dtype} threads={args.threads} "
        f"prompt={args.prompt_len} new={args.new_tokens} runs={args.runs} {versions}"
    )
    print(title)
    print(f"{'engine':<18}{'tok/s':>8}{'TTFT ms':>9}{'TPOT ms':>9}{'GB/s':>7}{'of BW':>7}")
    tps: dict[str, float] = {}
    ttfts: dict[str, float] = {}
    bw_share: dict[str, float] = {}
    for name, vals in rows.items():
        if not vals:
            continue
        ttft = statistics.median(v[0] for v in vals)
        total = statistics.median(v[1] for v in vals)
        tpot = (total - ttft) / (args.new_tokens - 1)
        tps[name], ttfts[name] = args.new_tokens / total, ttft
        line = f"{name:<18}{tps[name]:>8.1f}{ttft * 1e3:>9.1f}{tpot * 1e3:>9.2f}"
        if name.startswith("kvserve"):  # the bytes are kvserve's; the peers' differ
            gbs = step_bytes / tpot / 1e9
            bw_share[name] = gbs / bw
            line += f"{gbs:>7.2f}{gbs / bw:>7.1%}"
        print(line)
    print(
        f"memory bandwidth (sum of 1 GiB float32, {args.threads} threads): {bw:.1f} GB/s; "
        f"a kvserve decode step reads ~{step_bytes / 1e6:.1f} MB: resident weights "
        f"{weight_bytes / 1e6:.1f} MB (embedding table {embedding_bytes / 1e6:.1f} MB, "
        f"only gathered, not counted) + live KV {kv_row_bytes * avg_ctx / 1e6:.1f} MB "
        f"(mean context {avg_ctx:.0f} x {kv_row_bytes} B)"
    )
    for peer in ("llama.cpp", "hf-static"):
        if peer not in tps:
            continue
        for name in (n for n in tps if n.startswith("kvserve")):
            print(
                f"ratio {name} / {peer}: tok/s {tps[name] / tps[peer]:.2f}x, "
                f"TTFT {ttfts[name] / ttfts[peer]:.2f}x (lower is faster)"
            )
    if llama_ids:
        same = common_prefix(kvserve_ids, llama_ids)
        print(f"greedy tokens equal to llama.cpp's: first {same} of {args.new_tokens}")
    if args.plot:
        title += (
            f"; memory bandwidth {bw:.1f} GB/s, a kvserve decode step reads "
            f"~{step_bytes / 1e6:.1f} MB"
        )
        draw(args.plot, title, tps, ttfts, bw_share)


if __name__ == "__main__":
    main()
