"""Failover under load: three `kvserve serve` replicas behind SGLang's router (cache_aware, with
the cluster's FAILOVER_DEFAULTS), clients sending non-streaming completions and chat
completions, and the replica serving them SIGKILLed while they are in flight; then the same
with one client, and the busy one of the two replicas left. No client may see a failure: a
killed replica's connections break before a non-streaming response has sent its headers, the
router answers that as a retryable 500, and with one failure opening the dead replica's
circuit its retry goes to a live replica. (With the router's own `--cb-failure-threshold 10`
cache_aware sends all five attempts of a lone request back to the dead replica and the client
gets the 500; under load, several requests' failures open the circuit sooner.) A stream that
has started cannot be retried by anyone, so streams are not part of this promise
(`python -m benchmarks.cluster --kill-one --stream` shows them cut off)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from server_helpers import ROUTER_PYTHON, ServerProcess, free_port

from kvserve import cluster

CLIENTS = 4
PER_CLIENT = 6
MAX_TOKENS = 32  # with ignore_eos: a request is in flight for many engine steps
LONE_REQUESTS = 12  # the kill comes after the first: several are left to send after it
LONE_MAX_TOKENS = 32  # one request at a time: longer, so that the kill finds it running
SYSTEM = "Shared instructions. " + " ".join(f"item{i}" for i in range(40))


@dataclass(slots=True)
class Outcome:
    path: str
    start: float  # time.monotonic()
    end: float
    status: int | str  # the HTTP status, or the name of the transport error
    completion_tokens: int | None
    body: str


@pytest.fixture
def three_replicas(chat_checkpoint: Path, tmp_path: Path):
    if not ROUTER_PYTHON.exists():
        msg = f"sglang-router is not installed at {ROUTER_PYTHON} (scripts/setup_router.sh)"
        if os.environ.get("CI"):
            pytest.fail(msg)  # CI installs it: its absence is a failure, not a skip
        pytest.skip(msg)
    serve = ["--model", str(chat_checkpoint), "--served-model-name", "tiny-chat"]
    serve += ["--dtype", "float32", "--num-kv-blocks", "256"]  # 3 replicas: a small pool each
    config = cluster.ClusterConfig(
        replicas=3,
        host="127.0.0.1",
        port=free_port(),
        policy="cache_aware",
        router_python=ROUTER_PYTHON,
        router_args=(),  # FAILOVER_DEFAULTS are what is under test
        serve_args=tuple(serve),
        log_dir=tmp_path,
        startup_timeout_s=180,
    )
    replicas, router = cluster.start(config)
    try:
        yield [ServerProcess(m.url, m.proc, m.log_path, None) for m in replicas], router
    finally:
        cluster.stop([router, *replicas])


def client(url: str, index: int, n: int, max_tokens: int, outcomes: list[Outcome]) -> None:
    """n requests one after another, completions and chat in turn; all share SYSTEM, so
    cache_aware sends them to one replica. list.append is atomic: threads share outcomes."""
    with httpx.Client(base_url=url, timeout=60) as http:
        for i in range(n):
            body: dict = {"model": "tiny-chat", "max_tokens": max_tokens, "ignore_eos": True}
            if (index + i) % 2:
                path = "/v1/chat/completions"
                body["messages"] = [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"client {index} question {i}"},
                ]
            else:
                path = "/v1/completions"
                body["prompt"] = f"{SYSTEM} client {index} question {i}:"
            start = time.monotonic()
            try:
                r = http.post(path, json=body)
                status, text = r.status_code, r.text
                tokens = r.json()["usage"]["completion_tokens"] if status == 200 else None
            except httpx.HTTPError as e:
                status, text, tokens = type(e).__name__, str(e), None
            outcomes.append(Outcome(path, start, time.monotonic(), status, tokens, text))


def served(replica: ServerProcess) -> float:
    # a labelled counter has no sample until its first request: a replica that served none
    return replica.metrics().get("vllm:request_success_total", 0.0)


def kill_under_load(
    router: cluster.Member,
    live: list[ServerProcess],
    clients: int,
    per_client: int,
    max_tokens: int,
    kill_after: int,
) -> list[ServerProcess]:
    """Run the clients; once kill_after requests are done, SIGKILL the replica that is running
    requests; wait for the clients. Checks that every request succeeded, that some were in
    flight at the kill, and that the replicas left served every request sent after it; returns
    those replicas."""
    outcomes: list[Outcome] = []
    threads = [
        threading.Thread(
            target=client, args=(router.url, i, per_client, max_tokens, outcomes), daemon=True
        )
        for i in range(clients)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(outcomes) < kill_after:
        assert time.monotonic() < deadline, outcomes
        time.sleep(0.02)
    # what each replica has served, read first: nothing may stand between seeing requests
    # running and the kill (a tiny model finishes a request in milliseconds)
    served_before = [served(r) for r in live]
    # each client sends its next request as soon as one returns, so this sees a request near
    # its start and the kill lands well inside it
    while max(running := [r.metrics()["vllm:num_requests_running"] for r in live]) == 0:
        assert time.monotonic() < deadline, "no replica ever ran a request"
        time.sleep(0.01)
    victim = live[running.index(max(running))]  # cache_aware keeps them all on one
    os.kill(victim.proc.pid, signal.SIGKILL)
    survivors = [r for r in live if r is not victim]
    before = sum(n for r, n in zip(live, served_before, strict=True) if r is not victim)
    killed_at = time.monotonic()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a client never finished"
    assert victim.proc.wait(timeout=10) == -signal.SIGKILL

    router_log = re.sub(r"\x1b\[[0-9;]*m", "", router.log_path.read_text(errors="replace"))[-3000:]
    failed = [o for o in outcomes if o.status != 200 or o.completion_tokens != max_tokens]
    assert failed == [], f"{len(failed)} of {len(outcomes)} failed:\n{failed}\n{router_log}"
    assert len(outcomes) == clients * per_client
    # the kill hit requests in flight (else this tested only the routing of new ones)
    in_flight = [o for o in outcomes if o.start < killed_at < o.end]
    assert in_flight, f"no request was in flight at the kill (running: {running})"
    # every request sent after the kill was served by the replicas left
    after = [o for o in outcomes if o.start > killed_at]
    assert after, "every request was sent before the kill"
    gained = sum(served(r) for r in survivors) - before
    assert gained >= len(after), (gained, len(after), len(in_flight))
    return survivors


def test_killing_replicas_mid_run_fails_no_request(three_replicas) -> None:
    replicas, router = three_replicas
    # one of three killed under CLIENTS concurrent clients
    left = kill_under_load(router, replicas, CLIENTS, PER_CLIENT, MAX_TOKENS, PER_CLIENT)
    # then one of the two left under a lone request: it alone fails on the dead replica, so it
    # is retried elsewhere only if its one failure opened that replica's circuit (under load,
    # the failures of several requests add up to the router's default threshold of 10)
    kill_under_load(router, left, 1, LONE_REQUESTS, LONE_MAX_TOKENS, 1)
