"""`kvserve cluster`: N `kvserve serve` replicas on loopback ports behind SGLang's router.

kvserve does not route: past one process, replicas sit behind an existing cache-aware router
(SGLang's, `sglang-router`, a peer in its own venv; scripts/setup_router.sh). This starts the
replicas, waits until each answers /health, starts the router in front of them
(``--policy cache_aware`` by default, any other router flag passed through), and supervises
the set: a replica that dies is logged and left to the router's health checks, which take it
out while the others keep serving; the router dying, or SIGINT / SIGTERM, stops everything.

Processes, not threads: each replica is a whole server with its own engine, KV pool and
prefix cache, exactly as it would run on its own machine.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)

DEFAULT_ROUTER_PYTHON = Path(".peers/sglang-router/bin/python")
ROUTER_PYTHON_ENV = "KVSERVE_SGLANG_ROUTER_PYTHON"
# the router's flags for fast failover, unless --router-args sets them: one failed call opens a
# replica's circuit (so the router's retry goes to another replica at once, not five times to
# the dead one), and a health check every second takes a dead replica out. A non-streaming
# request in flight on a replica that dies is such a failed call (its connection breaks, the
# router retries it); with the router's default threshold of 10, cache_aware picks the dead
# replica for all five attempts of a lone request and the client gets a 500 (measured with
# sglang-router 0.3.2; tests/test_cluster_failover.py kills a replica under load)
FAILOVER_DEFAULTS = {
    "--cb-failure-threshold": "1",
    "--health-check-interval-secs": "1",
    "--health-failure-threshold": "1",
}


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    replicas: int
    host: str  # the router's
    port: int  # the router's
    policy: str
    router_python: Path
    router_args: tuple[str, ...]  # passed to sglang_router.launch_router as they are
    serve_args: tuple[str, ...]  # passed to every `kvserve serve`
    log_dir: Path
    startup_timeout_s: float = 600.0
    # torch threads of each replica: the machine's cores split among them by default, since
    # replicas that each take every core spin against each other (measured on 2 cores, 3
    # replicas x 2 threads: TTFT p50 1.4 s vs 0.2 s for one replica)
    threads_per_replica: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= 64:
            raise ValueError(f"--replicas must be in 1..64, got {self.replicas}")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.threads_per_replica < 1:
            raise ValueError(f"--threads-per-replica must be >= 1, got {self.threads_per_replica}")


@dataclass(slots=True)
class Member:
    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the cluster process dies, however it dies (a
    SIGKILL runs no cleanup of ours). Linux's PR_SET_PDEATHSIG; elsewhere nothing."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def _spawn(
    name: str, argv: list[str], log_dir: Path, url: str, env: dict[str, str] | None = None
) -> Member:
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 (no threads run in the parent yet)
        )
    return Member(name, url, proc, log_path)


def _wait(member: Member, path: str, ok, timeout_s: float, headers: dict[str, str]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if member.proc.poll() is not None:
            tail = member.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{member.name} exited ({member.proc.returncode}):\n{tail}")
        try:
            r = httpx.get(member.url + path, headers=headers, timeout=2)
            if ok(r):
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{member.name} did not come up within {timeout_s:g} s ({member.log_path})")


def _router_key(router_args: Sequence[str]) -> dict[str, str]:
    args = list(router_args)
    if "--api-key" in args and args.index("--api-key") + 1 < len(args):
        return {"Authorization": f"Bearer {args[args.index('--api-key') + 1]}"}
    return {}


def replica_endpoint(endpoint: str, index: int) -> str:
    """Replica ``index``'s KV events endpoint: a tcp port + index, else a ``_dp{index}``
    suffix (vLLM's rule for its data-parallel ranks); replica 0 keeps the endpoint."""
    if index == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + index}"
    return f"{endpoint}_dp{index}"


# `kvserve serve` flags that name a resource one process owns: each replica gets its own
PER_REPLICA_FLAGS: dict[str, Callable[[str, int], str]] = {
    "--kv-events-endpoint": replica_endpoint,
    "--kv-events-replay-endpoint": replica_endpoint,
    "--prefix-cache-dir": lambda d, i: str(Path(d) / f"replica-{i}"),
}


def replica_serve_args(args: Sequence[str], index: int) -> list[str]:
    """Replica ``index``'s serve flags: its own KV events endpoints (port + index, as vLLM's
    data-parallel ranks) and its own prefix-cache directory (DIR/replica-{index})."""
    out = list(args)
    for i, arg in enumerate(out):
        flag, eq, value = arg.partition("=")
        if flag not in PER_REPLICA_FLAGS:
            continue
        if eq:
            out[i] = f"{flag}={PER_REPLICA_FLAGS[flag](value, index)}"
        elif i + 1 < len(out):
            out[i + 1] = PER_REPLICA_FLAGS[flag](out[i + 1], index)
    return out


def start(config: ClusterConfig) -> tuple[list[Member], Member]:
    """Start the replicas, wait for their /health, then the router in front of them; returns
    (replicas, router). On failure everything started is stopped again."""
    started: list[Member] = []
    try:
        replicas = []
        for i in range(config.replicas):
            port = free_port()
            serve_args = replica_serve_args(config.serve_args, i)
            argv = [sys.executable, "-m", "kvserve.cli", "serve", *serve_args]
            argv += ["--host", "127.0.0.1", "--port", str(port)]
            url = f"http://127.0.0.1:{port}"
            threads = {"OMP_NUM_THREADS": str(config.threads_per_replica)}
            member = _spawn(f"replica-{i}", argv, config.log_dir, url, threads)
            started.append(member)
            replicas.append(member)
        for member in replicas:  # they load in parallel
            _wait(member, "/health", lambda r: r.status_code == 200, config.startup_timeout_s, {})
            logger.info("%s: %s (pid %d)", member.name, member.url, member.proc.pid)
        argv = [str(config.router_python), "-m", "sglang_router.launch_router"]
        argv += ["--host", config.host, "--port", str(config.port), "--policy", config.policy]
        for flag, value in FAILOVER_DEFAULTS.items():
            if flag not in config.router_args:
                argv += [flag, value]
        if "--prometheus-port" not in config.router_args:
            # its default (29000) is one fixed port: a second cluster on the machine would die
            argv += ["--prometheus-port", str(free_port())]
        argv += [*config.router_args, "--worker-urls", *[m.url for m in replicas]]
        url = f"http://{config.host}:{config.port}"
        router = _spawn("router", argv, config.log_dir, url)
        started.append(router)

        def registered(r: httpx.Response) -> bool:
            return r.status_code == 200 and bool(r.json().get("data"))

        key = _router_key(config.router_args)
        _wait(router, "/v1/models", registered, config.startup_timeout_s, key)
        logger.info("router: %s (pid %d), policy %s", url, router.proc.pid, config.policy)
        return replicas, router
    except BaseException:
        stop(started)
        raise


def stop(members: Sequence[Member], timeout_s: float = 15.0) -> None:
    """SIGTERM every member (each server shuts down cleanly), then SIGKILL what lingers."""
    for m in members:
        if m.proc.poll() is None:
            m.proc.terminate()
    deadline = time.monotonic() + timeout_s
    for m in members:
        try:
            m.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            m.proc.kill()
            m.proc.wait()


def run(config: ClusterConfig) -> int:
    """Start the set and supervise it until SIGINT / SIGTERM or the router exits."""
    if not config.router_python.exists():
        raise FileNotFoundError(
            f"no Python with sglang-router at {config.router_python}: run "
            f"scripts/setup_router.sh, or pass --router-python (or set {ROUTER_PYTHON_ENV})"
        )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health probe
    stopping: list[bool] = []
    previous = signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        replicas, router = start(config)
    except BaseException:
        signal.signal(signal.SIGTERM, previous)
        raise
    members = [router, *replicas]  # the router first: no request goes to a stopping replica
    print(f"kvserve cluster: router {router.url} (pid {router.proc.pid})", flush=True)
    for m in replicas:
        print(f"kvserve cluster: {m.name} {m.url} (pid {m.proc.pid})", flush=True)
    print(f"kvserve cluster: logs in {config.log_dir}", flush=True)
    down: set[str] = set()
    try:
        while not stopping:
            if router.proc.poll() is not None:
                logger.error("the router exited (%d): stopping the cluster", router.proc.returncode)
                return 1
            for m in replicas:
                if m.name not in down and m.proc.poll() is not None:
                    down.add(m.name)
                    # the router's health checks take it out; the others keep serving
                    logger.warning(
                        "%s exited (%d); %d of %d replicas left",
                        m.name,
                        m.proc.returncode,
                        len(replicas) - len(down),
                        len(replicas),
                    )
            time.sleep(0.5)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        stop(members)
        signal.signal(signal.SIGTERM, previous)


def add_cluster_args(p: argparse.ArgumentParser, default_port: int) -> None:
    """The `kvserve cluster` flags (cli.py owns the parser)."""
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--host", default="127.0.0.1", help="the router's address")
    p.add_argument("--port", type=int, default=default_port, help="the router's port")
    p.add_argument(
        "--policy",
        default="cache_aware",
        choices=["cache_aware", "round_robin", "random", "power_of_two"],
        help="the router's policy",
    )
    p.add_argument(
        "--router-python",
        default=None,
        help="a Python with sglang-router installed (default: $KVSERVE_SGLANG_ROUTER_PYTHON, "
        "else .peers/sglang-router/bin/python from scripts/setup_router.sh)",
    )
    p.add_argument(
        "--router-args", default="", help="more sglang_router.launch_router flags, one string"
    )
    p.add_argument(
        "--serve-args", default="", help="`kvserve serve` flags for every replica, one string"
    )
    p.add_argument(
        "--threads-per-replica",
        type=int,
        default=None,
        help="torch threads of each replica (default: this machine's cores / --replicas, at "
        "least 1; replicas that all take every core slow each other down)",
    )
    p.add_argument("--log-dir", default=None, help="replica and router logs (default: a tmp dir)")
    p.add_argument("--verbose", "-v", action="store_true")


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    router_python = args.router_python or os.environ.get(ROUTER_PYTHON_ENV) or DEFAULT_ROUTER_PYTHON
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="kvserve-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    return ClusterConfig(
        replicas=args.replicas,
        host=args.host,
        port=args.port,
        policy=args.policy,
        router_python=Path(router_python),
        router_args=tuple(shlex.split(args.router_args)),
        serve_args=tuple(shlex.split(args.serve_args)),
        log_dir=log_dir,
        threads_per_replica=(
            default_threads(args.replicas)
            if args.threads_per_replica is None
            else args.threads_per_replica
        ),
    )


def default_threads(replicas: int) -> int:
    """This process's usable cores split among ``replicas``, at least 1 each."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, replicas))
