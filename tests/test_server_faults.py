"""Fault containment against a real `kvserve serve` process whose model raises on chosen steps
(KVSERVE_FAULT_STEPS): a failed step fails only its requests (in-band SSE error, or a JSON 500,
naming the failure), the others finish, failures in a row restart the loop and it serves
again, and only a loop that keeps failing past its restart limit makes /health 503.

One process, one scenario: the model steps are counted from the start of the process, and with
--max-num-seqs 1 and sequential requests every step number below is deterministic.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import ServerProcess, start_server

# model steps that raise: 20 (mid-stream), 31-33 (three in a row: a restart), then from 37 on
# every step (restarts until the limit, then the loop dies)
FAULT_STEPS = "20,31-33,37-1000"


@pytest.fixture(scope="module")
def faulty_server(chat_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSERVE_FAULT_STEPS", FAULT_STEPS)
        proc = start_server(
            chat_checkpoint, tmp_path_factory.mktemp("fault-logs"), "--max-num-seqs", "1",
            "--log-interval", "1",
        )  # fmt: skip
    yield proc
    proc.stop()


def complete(http: httpx.Client, prompt: str, max_tokens: int) -> httpx.Response:
    body = {
        "model": "tiny-chat", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
        "temperature": 0.0,
    }  # fmt: skip
    return http.post("/v1/completions", json=body)


def assert_engine_error(r: httpx.Response, step: int) -> None:
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["type"] == "server_error"
    assert error["message"].endswith(
        f"failed in the engine: InjectedFault: injected fault at model step {step}"
    ), error


def wait_health(server: ServerProcess, status: int, timeout: float = 10.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while (r := httpx.get(f"{server.url}/health", timeout=5)).status_code != status:
        assert time.monotonic() < deadline, f"/health stayed {r.status_code}:\n{server.log()}"
        time.sleep(0.05)
    return r


def test_faults_fail_their_requests_restart_the_loop_and_finally_kill_it(
    faulty_server: ServerProcess,
) -> None:
    server = faulty_server
    http = server.http()

    # 1. a stream fails at model step 20, its 20th token: 19 token chunks, then the error in
    # band. A request sent meanwhile waits (one sequence at a time) and is not in that step.
    body = {
        "model": "tiny-chat", "prompt": "Once upon", "max_tokens": 40, "ignore_eos": True,
        "logprobs": 0, "stream": True,
    }  # fmt: skip
    waiting: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: waiting.append(complete(http, "The cache", 5)))
    events = []
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                if len(events) == 3:
                    sender.start()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error"
    assert error["message"].endswith(
        "failed in the engine: InjectedFault: injected fault at model step 20"
    ), error
    chunks = [json.loads(e)["choices"][0] for e in events[:-2]]
    assert len(chunks) == 19 and all(c["finish_reason"] is None for c in chunks)

    # 2. the waiting request ran after the failed step (model steps 21-25) and got exactly the
    # tokens a fault-free run gives (its repeat, steps 26-30)
    sender.join(timeout=60)
    (served,) = waiting
    assert served.status_code == 200, served.text
    again = complete(http, "The cache", 5)
    assert again.status_code == 200
    first, second = served.json()["choices"][0], again.json()["choices"][0]
    assert first["finish_reason"] == "length" and first["text"] == second["text"]
    assert served.json()["usage"]["completion_tokens"] == 5
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200

    # 3. three failing steps in a row (31-33): three JSON 500s, then the loop restarts
    for step in (31, 32, 33):
        assert_engine_error(complete(http, "Hello", 1), step)
    wait_health(server, 200)
    ok = complete(http, "Hello there", 3)  # steps 34-36
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["finish_reason"] == "length"
    assert "the engine loop restarted after: RepeatedStepFailure: 3 engine steps in a row" in (
        server.log()
    )
    server.wait_idle(timeout=10)  # nothing running or waiting, no KV block held

    # 4. every step fails from 37 on: restarts 2 and 3 (steps 39 and 42), then the fourth
    # within the restart window (step 45) is one too many and the loop dies
    for step in range(37, 45):
        assert_engine_error(complete(http, "Hello", 1), step)
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert_engine_error(complete(http, "Hello", 1), 45)
    health = wait_health(server, 503)
    assert "RepeatedStepFailure" in health.json()["error"]["message"]
    refused = complete(http, "Hello", 1)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"


def test_restart_limits_come_from_the_flags(chat_checkpoint: Path, tmp_path: Path) -> None:
    # one failed step is a restart (--max-consecutive-step-failures 1), and no restart is
    # allowed (--max-restarts 0): the first fault stops the engine. With the defaults the same
    # fault only fails its request (test above, step 20)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSERVE_FAULT_STEPS", "1")
        proc = start_server(
            chat_checkpoint, tmp_path, "--max-consecutive-step-failures", "1",
            "--max-restarts", "0", "--restart-window-s", "5",
        )  # fmt: skip
    try:
        with proc.http() as http:
            r = complete(http, "Hello", 4)
            assert r.status_code == 500
            assert "injected fault at model step 1" in r.json()["error"]["message"]
            deadline = time.monotonic() + 10  # the loop dies right after sending the error
            while (health := http.get("/health")).status_code == 200:
                assert time.monotonic() < deadline, "the engine loop did not stop"
                time.sleep(0.05)
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    finally:
        proc.stop()
