"""serve-poisson: kvserve's OpenAI server vs llama.cpp's (llama-cpp-python), same GGUF file.

Both servers run side by side on this machine; for every run and request rate the same
prompts go to one, then the other (alternating which goes first). Requests arrive as a
Poisson process, at most --max-concurrency in flight; greedy, EOS suppressed so every request
generates exactly its output length. Reported: medians over runs of TTFT / TPOT / ITL (median
and p99), output tokens/s and goodput (requests/s meeting the TTFT and TPOT SLOs), with the
kvserve / llama.cpp ratios. Definitions are vllm bench serve's (see serve_client.py).

    python -m benchmarks.serve --llama-python /path/to/venv/bin/python

--llama-python is a Python with `llama-cpp-python[server]` installed (compiling it takes a few
minutes; it is a peer, not a kvserve dependency). Each run uses fresh prompts, so neither
server's prompt cache helps across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import plot
from benchmarks.serve_client import run_poisson
from kvserve.default_model import default_model_path
from kvserve.tokenizer import Tokenizer

WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force"
).split()
EOS_IDS = (0, 2)  # SmolLM2: <|endoftext|>, <|im_end|>


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_prompts(tok: Tokenizer, n: int, seed: int) -> list[tuple[str, int, int]]:
    """(text, prompt tokens, output tokens): prompts uniform in [64, 512] tokens of random
    words, outputs uniform in [32, 128] tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target = rng.randint(64, 512)
        words = [rng.choice(WORDS) for _ in range(target)]
        ids = tok.encode(" ".join(words), add_special_tokens=False)[:target]
        out.append((tok.decode(ids), len(ids), rng.randint(32, 128)))
    return out


def start(name: str, argv: list[str], url: str, log_dir: Path) -> subprocess.Popen:
    log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: {(log_dir / f'{name}.log').read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{name} did not start")


def payload(server: str, text: str, max_tokens: int) -> dict:
    body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    if server == "kvserve":
        return {**body, "ignore_eos": True}
    return {**body, "logit_bias": {str(t): -100.0 for t in EOS_IDS}}  # llama.cpp: no ignore_eos


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-python", default=None, help="a Python with llama-cpp-python[server]")
    p.add_argument("--rates", default="1,2,inf", help="request rates (req/s), comma-separated")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument(
        "--kvserve-args", default="", help="extra `kvserve serve` flags, e.g. engine options"
    )
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    plot.add_plot_arg(p)
    args = p.parse_args(argv)

    gguf = default_model_path()
    tok = Tokenizer.load(gguf.parent, gguf)
    rates = [float(r) for r in args.rates.split(",")]
    log_dir = Path(tempfile.mkdtemp(prefix="kvserve-bench-"))
    servers: dict[str, tuple[str, subprocess.Popen]] = {}
    kv_port = free_port()
    kv_argv = [sys.executable, "-m", "kvserve.cli", "serve", "--dtype", args.dtype]
    # compiled before /health: a background compile would share the CPU with the first run
    kv_argv += ["--compile-mode", "sync"]
    kv_argv += ["--port", str(kv_port), "--log-interval", "60", *args.kvserve_args.split()]
    url = f"http://127.0.0.1:{kv_port}"
    servers["kvserve"] = (url, start("kvserve", kv_argv, url, log_dir))
    if args.llama_python:
        port = free_port()
        argv = [args.llama_python, "-m", "llama_cpp.server", "--model", str(gguf)]
        argv += ["--n_threads", str(args.threads), "--n_threads_batch", str(args.threads)]
        argv += ["--n_ctx", "4096", "--host", "127.0.0.1", "--port", str(port)]
        # by default a new request interrupts the one streaming; a server must finish each
        argv += ["--interrupt_requests", "False"]
        url = f"http://127.0.0.1:{port}"
        servers["llama.cpp"] = (url, start("llama.cpp", argv, url, log_dir))
    else:
        print("no --llama-python: measuring kvserve alone", file=sys.stderr)

    summaries: dict[tuple[float, str], list[dict[str, float]]] = {}
    try:
        for run in range(args.runs):
            for i, rate in enumerate(rates):
                prompts = make_prompts(tok, args.num_requests, seed=1000 * run + i)
                order = list(servers) if run % 2 == 0 else list(reversed(servers))
                for name in order:
                    url = servers[name][0]
                    bodies = [payload(name, text, n_out) for text, _, n_out in prompts]
                    result = asyncio.run(
                        run_poisson(url, bodies, rate, args.max_concurrency, seed=run)
                    )
                    s = result.summary(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
                    summaries.setdefault((rate, name), []).append(s)
                    failed = [r.error for r in result.results if not r.ok][:2]
                    print(
                        f"run {run} rate {rate:g} {name}: {s['completed']:.0f} done, "
                        f"{s['output_tok_s']:.1f} tok/s, goodput {s['goodput_req_s']:.2f} req/s"
                        + (f", failures: {failed}" if failed else ""),
                        file=sys.stderr,
                    )
    finally:
        for _, proc in servers.values():
            proc.terminate()
    report(summaries, rates, list(servers), args)


def report(summaries, rates: list[float], names: list[str], args: argparse.Namespace) -> None:
    def med(rate: float, name: str, key: str) -> float:
        return statistics.median(s[key] for s in summaries[(rate, name)])

    title = (
        f"serve-poisson: {args.num_requests} requests per run, prompts 64-512 tokens, outputs "
        f"32-128 tokens, max concurrency {args.max_concurrency}; medians of {args.runs} runs; "
        f"SLO TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms"
    )
    print(title)
    medians: dict[tuple[float, str], dict[str, float]] = {}
    header = (
        f"{'rate':>5} {'server':<10} {'done':>5} {'tok/s':>7} {'req/s':>6} {'goodput':>7} "
        f"{'TTFT med':>9} {'TTFT p99':>9} {'TPOT med':>9} {'TPOT p99':>9} {'ITL med':>8} "
        f"{'ITL p99':>8}"
    )
    print(header)
    for rate in rates:
        for name in names:
            m = medians[(rate, name)] = {k: med(rate, name, k) for k in summaries[(rate, name)][0]}
            print(
                f"{rate:>5g} {name:<10} {m['completed']:>5.0f} {m['output_tok_s']:>7.1f} "
                f"{m['req_s']:>6.2f} {m['goodput_req_s']:>7.2f} {m['ttft_med_ms']:>9.0f} "
                f"{m['ttft_p99_ms']:>9.0f} {m['tpot_med_ms']:>9.1f} {m['tpot_p99_ms']:>9.1f} "
                f"{m['itl_med_ms']:>8.1f} {m['itl_p99_ms']:>8.1f}"
            )
    if "llama.cpp" in names:
        for rate in rates:
            good = [med(rate, n, "goodput_req_s") for n in ("kvserve", "llama.cpp")]
            tps = [med(rate, n, "output_tok_s") for n in ("kvserve", "llama.cpp")]
            ratio = good[0] / good[1] if good[1] > 0 else float("inf")
            print(
                f"rate {rate:g}: kvserve / llama.cpp goodput {ratio:.2f}x, "
                f"output tokens/s {tps[0] / tps[1]:.2f}x"
            )
    if args.plot:
        title += f"; kvserve serve --dtype {args.dtype} {args.kvserve_args}".rstrip()
        if "llama.cpp" in names:
            title += f", llama.cpp server with {args.threads} threads, the same GGUF"
        slos = (args.slo_ttft_ms, args.slo_tpot_ms)
        draw(args.plot, title, medians, rates, names, slos)


def draw(
    path,
    title: str,
    medians: dict[tuple[float, str], dict[str, float]],
    rates: list[float],
    names: list[str],
    slos: tuple[float, float],
) -> None:
    """Per request rate: output tokens/s and goodput per server (kvserve's bars carry the
    kvserve / llama.cpp ratio), TTFT and TPOT median / p99 against the SLOs (TTFT, TPOT ms)."""
    groups = [f"{r:g} req/s" if r != float("inf") else "all at once" for r in rates]

    def by_server(key: str) -> dict[str, list[float]]:
        return {n: [medians[(r, n)][key] for r in rates] for n in names}

    def ratios(key: str, fmt: str) -> dict[str, list[str]]:
        notes = {n: [fmt.format(medians[(r, n)][key]) for r in rates] for n in names}
        if "llama.cpp" in names:
            for i, r in enumerate(rates):
                peer = medians[(r, "llama.cpp")][key]
                ratio = medians[(r, "kvserve")][key] / peer if peer > 0 else float("inf")
                notes["kvserve"][i] += f"\n{ratio:.2f}x"
        return notes

    def pcts(stem: str) -> dict[str, list[float]]:
        return {
            f"{n} {q}": [medians[(r, n)][f"{stem}_{key}_ms"] for r in rates]
            for n in names
            for q, key in (("median", "med"), ("p99", "p99"))
        }

    vs = " (kvserve / llama.cpp)" if "llama.cpp" in names else ""
    plot.figure(
        path,
        title,
        [
            plot.GroupedBars(
                groups,
                by_server("output_tok_s"),
                "output tokens/s",
                ratios("output_tok_s", "{:.0f}"),
                title="output tokens/s" + vs,
                xlabel="request rate (Poisson)",
            ),
            plot.GroupedBars(
                groups,
                by_server("goodput_req_s"),
                "goodput (requests/s within the SLOs)",
                ratios("goodput_req_s", "{:.2f}"),
                title="goodput" + vs,
                xlabel="request rate (Poisson)",
            ),
            plot.GroupedBars(
                groups,
                pcts("ttft"),
                "time to first token (ms)",
                title="TTFT median / p99",
                refs=[(slos[0], "SLO")],
                colors=plot.PAIRED,
                xlabel="request rate (Poisson)",
            ),
            plot.GroupedBars(
                groups,
                pcts("tpot"),
                "time per output token (ms)",
                title="TPOT median / p99",
                refs=[(slos[1], "SLO")],
                colors=plot.PAIRED,
                xlabel="request rate (Poisson)",
            ),
        ],
        ncols=2,
    )


if __name__ == "__main__":
    main()
