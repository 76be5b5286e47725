"""How long kvserve takes to start on the default model: cold (a fresh cache dir: kernel build,
row-threshold measurement, compile) and warm (the same cache dir again), for the commands
people run first.

    python -m benchmarks.startup            # warm starts, in the user's cache dir
    python -m benchmarks.startup --cold     # one cold start of each in a fresh dir, then warm

Each figure is the wall time from starting the process:
- generate: until the process exits after its reply (`kvserve generate --prompt ... `);
- chat: until it prints its first reply (one line on stdin, then end of input);
- serve: until /health answers 200, and until the first chat reply arrives.
A background compile (serve, chat) may still run after these: the figures say when a user has
an answer, which is what the start-up aims are about.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

PROMPT = "What is a KV cache?"
MAX_TOKENS = 32


def _kvserve() -> list[str]:
    return [sys.executable, "-m", "kvserve.cli"]


def time_generate(env: dict[str, str]) -> float:
    start = time.monotonic()
    subprocess.run(
        [*_kvserve(), "generate", "--chat", "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS)],
        env=env,
        check=True,
        capture_output=True,
        timeout=1800,
    )
    return time.monotonic() - start


def time_chat(env: dict[str, str]) -> float:
    """Seconds until the chat's first reply is on stdout."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [*_kvserve(), "chat", "--max-tokens", str(MAX_TOKENS)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"{PROMPT}\n".encode())
    proc.stdin.flush()
    # input() writes its prompt "> " to stdout first; the reply's first byte follows it
    while proc.stdout.read(2) != b"> ":
        pass
    proc.stdout.read(1)
    first = time.monotonic() - start
    proc.stdin.close()
    proc.wait(timeout=600)
    return first


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_serve(env: dict[str, str]) -> tuple[float, float]:
    """(seconds to /health 200, seconds to the first chat reply)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    proc = subprocess.Popen(
        [*_kvserve(), "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvserve serve exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() - start > 1800:
                raise TimeoutError("kvserve serve never became healthy")
            time.sleep(0.05)
        healthy = time.monotonic() - start
        body = {
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).raise_for_status()
        replied = time.monotonic() - start
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    return healthy, replied


def run(label: str, env: dict[str, str]) -> None:
    gen = time_generate(env)
    print(f"{label:5} generate: reply and exit {gen:6.1f} s", flush=True)
    chat = time_chat(env)
    print(f"{label:5} chat:     first reply    {chat:6.1f} s", flush=True)
    healthy, replied = time_serve(env)
    print(f"{label:5} serve:    /health 200    {healthy:6.1f} s, first chat reply {replied:.1f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cold", action="store_true", help="first start everything in a fresh dir")
    p.add_argument("--runs", type=int, default=2, help="warm runs of each command")
    args = p.parse_args(argv)
    env = {**os.environ}
    fresh = None
    if args.cold:
        fresh = tempfile.mkdtemp(prefix="kvserve-startup-")
        env["KVSERVE_CACHE_DIR"] = fresh
    where = env.get("KVSERVE_CACHE_DIR", str(Path.home() / ".cache" / "kvserve"))
    print(f"startup: default model, prompt {PROMPT!r}, {MAX_TOKENS} tokens, cache dir {where}")
    try:
        if args.cold:
            # the first command builds the kernels and measures thresholds; each later command's
            # first start still compiles what it alone uses
            run("cold", env)
        for _ in range(args.runs):
            run("warm", env)
    finally:
        if fresh is not None:
            shutil.rmtree(fresh, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
