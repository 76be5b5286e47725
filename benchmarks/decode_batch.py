"""decode-B: B requests at once (batch 8 and 32 by default), each its own random 128-token
prompt, 64 new tokens, greedy, ignore EOS: kvserve's engine against llama.cpp's batched decode
(llama-cpp-python's low-level API in its own venv, benchmarks/peers/llama_batched.py: one
``llama_decode`` of B tokens per step, ``llama-batched-bench``'s generation phase) on the same
GGUF file and the same prompt ids, alternating within each run; prints per batch size the
medians of ``--runs``: prefill of all B prompts, aggregate decode tok/s, per-sequence TPOT,
the ratio kvserve / llama.cpp, and the bytes a kvserve decode step reads (resident weights +
the mean live KV of all B sequences) per step time against the memory bandwidth measured in
the same run.

    python -m benchmarks.decode_batch --model .bench-models/tinyllama-1.1b-Q4_0.gguf \\
        [--batch 8 32] [--prompt-len 128] [--new-tokens 64] [--runs 2] [--threads 2] \\
        [--dtype auto] [--llama-python .peers/llama/bin/python] [--plot FILE.png]

The phases, timed the same way for both engines: prefill = from the requests' arrival until
every sequence has its first token (all B prompts, one engine step: kvserve's
``max_num_batched_tokens`` is raised to B x prompt length so that no prompt is chunked and no
sequence starts decoding while another still prefills, as in llama.cpp's run); decode = the
remaining ``new - 1`` steps of all B sequences. kvserve's come from its outputs: prefill = the
largest ``ttft_s`` (arrival -> first token), decode = the largest ``decode_time_s`` (first
token -> finished; the same step for every sequence). Aggregate decode tok/s = B x (new - 1) /
decode. "wall s" is the whole ``LLM.generate`` call (llama.cpp: prefill + decode).

Random weights (benchmarks/synthetic_model.py): the tokens mean nothing, only the speed does;
sequences whose first 8 greedy ids equal llama.cpp's are counted for information only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import plot
from benchmarks.common import (
    default_peer_python,
    measure_bandwidth,
    random_prompt,
    resident_weight_bytes,
    start_llama_peer,
    with_dtype_fallback,
)
from kvserve.config import DEFAULT_KV_CACHE_MEMORY, SchedulerConfig
from kvserve.engine.llm import LLM
from kvserve.intmath import cdiv
from kvserve.models.model_session import ModelSession
from kvserve.sampling import SamplingParams

ENGINES = ("kvserve", "llama.cpp")
AGREE_TOKENS = 8  # greedy ids compared with llama.cpp's over this many first tokens


@dataclass(slots=True)
class BatchRun:
    """One batched generation: the phases' times and every sequence's ids."""

    prefill_s: float  # all B prompts, until every sequence has its first token
    decode_s: float  # the new - 1 decode steps of all B sequences
    wall_s: float
    token_ids: list[list[int]]


@dataclass(slots=True)
class Row:
    """Medians over the runs of one engine at one batch size."""

    prefill_s: float
    decode_s: float
    wall_s: float
    decode_tps: float  # B * (new - 1) / decode_s
    tpot_s: float  # per sequence: decode_s / (new - 1)


def run_kvserve(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> BatchRun:
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    ttfts = [o.ttft_s for o in outs]
    if max(ttfts) - min(ttfts) > 0.2 * max(ttfts):  # prefill was split: the split is off
        print(f"kvserve: first tokens {min(ttfts):.3f}-{max(ttfts):.3f} s apart", file=sys.stderr)
    return BatchRun(
        prefill_s=max(ttfts),
        decode_s=max(o.decode_time_s for o in outs),
        wall_s=wall,
        token_ids=[list(o.token_ids) for o in outs],
    )


def make_llm(session: ModelSession, batch: int, prompt_len: int, new_tokens: int) -> LLM:
    """kvserve's engine for B sequences: every prompt prefilled in one step, and a KV pool
    that holds all B whole (twice over, never less than the default), so that nothing is
    preempted."""
    spec = session.model.kv_cache_spec()  # the exact cache, 16-token blocks: LLM's defaults
    needed = batch * cdiv(prompt_len + new_tokens, spec.block_size) * spec.bytes_per_block
    return LLM(
        session=session,
        max_num_seqs=batch,
        max_num_batched_tokens=max(SchedulerConfig().max_num_batched_tokens, batch * prompt_len),
        enable_prefix_caching=False,  # runs repeat the prompts: a hit would skip the prefill
        kv_cache_memory=max(DEFAULT_KV_CACHE_MEMORY, 2 * needed),
    )


def start_llama(python: str, gguf: Path, prompts: list[list[int]], new: int, threads: int):
    """The llama.cpp peer, ready (retried without extra buffer types if it crashes)."""
    args = ["--model", str(gguf), "--prompt-ids", json.dumps(prompts)]
    args += ["--new-tokens", str(new), "--threads", str(threads)]
    return start_llama_peer(python, "llama_batched.py", args)


def median_row(runs: list[BatchRun], batch: int, new_tokens: int) -> Row:
    prefill = statistics.median(r.prefill_s for r in runs)
    decode = statistics.median(r.decode_s for r in runs)
    steps = new_tokens - 1
    wall = statistics.median(r.wall_s for r in runs)
    return Row(prefill, decode, wall, decode_tps=batch * steps / decode, tpot_s=decode / steps)


@dataclass(slots=True)
class BatchResult:
    """Both engines at one batch size."""

    rows: dict[str, Row]  # engine -> medians
    agree: int | None  # sequences whose first AGREE_TOKENS greedy ids equal llama.cpp's
    peer_info: dict  # the peer's PEER_READY record ({} without the peer)
    kv_row_bytes: int  # kvserve's KV bytes per token (all layers, K and V)
    preemptions: int  # kvserve's; 0 unless the KV pool was too small


def bench_batch(session: ModelSession, args: argparse.Namespace, batch: int) -> BatchResult:
    """Both engines at one batch size on the same B prompts, alternating within each run."""
    rng = random.Random(batch)  # each batch size its own fixed prompts
    prompts = [random_prompt(rng, args.prompt_len, session.config.vocab_size) for _ in range(batch)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    llm = make_llm(session, batch, args.prompt_len, args.new_tokens)
    # the warm-up has the runs' shapes: a B x prompt prefill step, then B-row decode steps
    llm.generate(prompts, dataclasses.replace(params, max_tokens=4), use_tqdm=False)
    llama = None
    if args.llama_python:
        llama = start_llama(args.llama_python, args.model, prompts, args.new_tokens, args.threads)
    runs: dict[str, list[BatchRun]] = {name: [] for name in ENGINES}
    for run in range(args.runs):  # alternate engines within each run
        runs["kvserve"].append(run_kvserve(llm, prompts, params))
        if llama is not None:
            res = llama.run()
            total = res["prefill_s"] + res["decode_s"]
            runs["llama.cpp"].append(
                BatchRun(res["prefill_s"], res["decode_s"], total, res["token_ids"])
            )
        # each run's figures too: on a noisy machine their spread says how far a median holds
        done = "; ".join(
            f"{n} prefill {r[-1].prefill_s:.2f} s, "
            f"decode {batch * (args.new_tokens - 1) / r[-1].decode_s:.1f} tok/s"
            for n, r in runs.items()
            if r
        )
        print(f"batch {batch}: run {run + 1}/{args.runs}: {done}", file=sys.stderr)
    info = {}
    if llama is not None:
        info = llama.info
        llama.close()
    agree = None
    if runs["llama.cpp"]:
        ours, theirs = runs["kvserve"][-1].token_ids, runs["llama.cpp"][-1].token_ids
        agree = sum(a[:AGREE_TOKENS] == b[:AGREE_TOKENS] for a, b in zip(ours, theirs, strict=True))
    return BatchResult(
        rows={n: median_row(r, batch, args.new_tokens) for n, r in runs.items() if r},
        agree=agree,
        peer_info=info,
        kv_row_bytes=llm.engine.spec.bytes_per_token,
        preemptions=llm.engine.stats().num_preemptions,
    )


def print_batch(
    batch: int, rows: dict[str, Row], step_bytes: float, bw: float, agree: int | None, n: int
) -> None:
    """One batch size's table; ``agree``: sequences whose first ``n`` ids equal llama.cpp's."""
    print(f"batch {batch}: {batch} prompts at once")
    head = f"{'engine':<11}{'prefill ms':>11}{'decode tok/s':>13}{'TPOT ms':>9}{'wall s':>8}"
    print(head + f"{'vs llama':>9}{'GB/s':>7}{'of BW':>7}")
    peer = rows.get("llama.cpp")
    for name, r in rows.items():
        line = f"{name:<11}{r.prefill_s * 1e3:>11.0f}{r.decode_tps:>13.1f}{r.tpot_s * 1e3:>9.1f}"
        line += f"{r.wall_s:>8.2f}"
        line += f"{r.decode_tps / peer.decode_tps:>8.2f}x" if peer else f"{'-':>9}"
        if name == "kvserve":  # the bytes are kvserve's; llama.cpp's differ (f16 KV, say)
            gbs = step_bytes / r.tpot_s / 1e9
            line += f"{gbs:>7.2f}{gbs / bw:>7.1%}"
        else:
            line += f"{'-':>7}{'-':>7}"
        print(line)
    if peer:
        ours = rows["kvserve"]
        print(
            f"ratio kvserve / llama.cpp: decode tok/s {ours.decode_tps / peer.decode_tps:.2f}x "
            f"(higher is faster), prefill time {ours.prefill_s / peer.prefill_s:.2f}x "
            f"(lower is faster)"
        )
    if agree is not None:
        print(
            f"sequences whose first {n} greedy ids equal llama.cpp's: {agree} of "
            f"{batch} (random weights: informational only)"
        )


def draw(path: Path, title: str, results: dict[int, dict[str, Row]]) -> None:
    """Decode tok/s and prefill time per batch size, kvserve's bars with their ratio."""
    groups = [f"batch {b}" for b in results]
    names = [n for n in ENGINES if all(n in rows for rows in results.values())]

    def panel(value, ylabel: str, subtitle: str) -> plot.GroupedBars:
        series = {n: [value(rows[n]) for rows in results.values()] for n in names}
        notes = {}
        if "llama.cpp" in names:
            ratio = [a / b for a, b in zip(series["kvserve"], series["llama.cpp"], strict=True)]
            notes["kvserve"] = [f"{r:.2f}x" for r in ratio]
        return plot.GroupedBars(groups, series, ylabel, notes, subtitle, xlabel="batch size")

    plot.figure(
        path,
        title,
        [
            panel(lambda r: r.decode_tps, "decode tok/s, all sequences (median)", "decode"),
            panel(lambda r: 1e3 * r.prefill_s, "prefill of all prompts, ms (median)", "prefill"),
        ],
    )


def report(
    args: argparse.Namespace, session: ModelSession, dtype: str, results: dict[int, BatchResult]
) -> None:
    """The tables, the bytes a step reads against the bandwidth measured now, the plot."""
    info = next((r.peer_info for r in results.values() if r.peer_info), {})
    bw = measure_bandwidth()
    weight_bytes, embedding_bytes = resident_weight_bytes(session.model)
    avg_ctx = args.prompt_len + args.new_tokens / 2  # mean live context of a decode step
    versions = f"torch={torch.__version__}"
    if info:
        versions += f" llama-cpp-python={info['llama_cpp_python']}"
        versions += f" (n_ubatch {info['n_ubatch']}, kv_unified {info['kv_unified']})"
        if not info.get("extra_bufts", True):
            versions += " (no AMX/repack buffers: it crashed with them)"
    title = (
        f"decode-B: model={args.model.name} dtype={dtype} "
        f"({str(session.model.dtype).removeprefix('torch.')}) threads={args.threads} "
        f"prompt={args.prompt_len} new={args.new_tokens} runs={args.runs} {versions}"
    )
    print(title)
    print("random weights: the tokens are not meaningful, only the speed is")
    for batch, res in results.items():
        kv_bytes = res.kv_row_bytes * avg_ctx * batch
        step_bytes = weight_bytes + kv_bytes
        print()
        agree_n = min(AGREE_TOKENS, args.new_tokens)
        print_batch(batch, res.rows, step_bytes, bw, res.agree, agree_n)
        print(
            f"a kvserve decode step reads ~{step_bytes / 1e6:.1f} MB: resident weights "
            f"{weight_bytes / 1e6:.1f} MB + live KV {kv_bytes / 1e6:.1f} MB ({batch} x mean "
            f"context {avg_ctx:.0f} x {res.kv_row_bytes} B); kvserve preemptions: "
            f"{res.preemptions}"
        )
    print(
        f"\nmemory bandwidth (sum of 1 GiB float32, {args.threads} threads): {bw:.1f} GB/s; "
        f"embedding table {embedding_bytes / 1e6:.1f} MB only gathered, not counted"
    )
    if args.plot:
        rows = {batch: res.rows for batch, res in results.items()}
        draw(args.plot, title + f"; memory bandwidth {bw:.1f} GB/s", rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help=".gguf file (both engines)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--llama-python",
        default=default_peer_python("llama"),
        help="Python of the llama-cpp-python venv (default: .peers/llama/bin/python if set up)",
    )
    plot.add_plot_arg(ap)
    args = ap.parse_args(argv)
    if args.model.suffix != ".gguf":
        ap.error(f"--model must be a .gguf file (llama.cpp loads the same file), got {args.model}")
    if args.new_tokens < 2 or min(args.batch) < 1:
        ap.error("--new-tokens must be >= 2 and every --batch >= 1")
    if args.llama_python is None:
        print("llama.cpp: not set up (bash benchmarks/peers/setup.sh llama)", file=sys.stderr)
    torch.set_num_threads(args.threads)

    session, dtype = with_dtype_fallback(lambda d: ModelSession.open(args.model, d), args.dtype)
    results = {batch: bench_batch(session, args, batch) for batch in args.batch}
    report(args, session, dtype, results)


if __name__ == "__main__":
    main()
