"""Server states a live process cannot be steered into on demand, tested in-process with
Starlette's TestClient: still loading, and an engine loop that fails mid-stream, restarts, and
dies once it has failed past its restart limit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvserve.config import EngineConfig
from kvserve.server.app import ServerState, build_app
from kvserve.server.config import ServerConfig
from kvserve.server.launch import load_served
from kvserve.server.metrics import ServerMetrics


def make_state() -> ServerState:
    holder: list[ServerState] = []
    metrics = ServerMetrics(
        "tiny-chat", lambda: None if holder[0].served is None else holder[0].served.engine.stats()
    )
    holder.append(ServerState(ServerConfig(), "tiny-chat", metrics))
    return holder[0]


def test_loading_is_503_with_retry_after() -> None:
    client = TestClient(build_app(make_state()))
    for method, path in [("GET", "/health"), ("GET", "/v1/models"), ("POST", "/tokenize")]:
        r = client.request(method, path, json={"prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["type"] == "server_error"
    assert client.get("/metrics").status_code == 200  # scrapable before the engine exists


@pytest.fixture
def live(chat_checkpoint: Path):
    state = make_state()
    state.served = load_served(
        EngineConfig(model=str(chat_checkpoint)), state.config, "tiny-chat", state.metrics
    )
    yield state
    state.served.engine.shutdown()


def test_a_loop_failure_is_sent_in_band_restarts_the_loop_and_past_its_limit_kills_it(
    live: ServerState,
) -> None:
    # engine.step itself raising is outside step()'s own containment: the loop restarts
    engine = live.served.engine.engine
    real_step, calls, always = engine.step, [], []

    def failing_step():
        calls.append(1)
        if len(calls) == 5 or always:
            raise RuntimeError("simulated device failure")
        return real_step()

    engine.step = failing_step
    client = TestClient(build_app(live))
    assert client.get("/health").status_code == 200
    body = {"prompt": "Hello", "max_tokens": 50, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200  # the stream had begun: the error comes in-band
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error"
    assert error["message"] == (
        "the engine loop restarted after: RuntimeError: simulated device failure"
    )
    assert all("choices" in json.loads(e) for e in events[:-2]) and len(events) > 3
    # restarted: healthy, serving, nothing held
    assert client.get("/health").status_code == 200
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert engine.kv_manager.pool.num_used_blocks == 0
    # failing for good: restarts 2 and 3 (max_restarts 3 within the window), then it dies
    always.append(True)
    for _ in range(2):
        r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 500 and r.json()["error"]["message"].startswith(
            "the engine loop restarted after: RuntimeError"
        )
        assert client.get("/health").status_code == 200
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 500
    assert r.json()["error"]["message"] == (
        "the engine loop died: RuntimeError('simulated device failure')"
    )
    health = client.get("/health")
    assert health.status_code == 503 and "simulated" in health.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert live.served.engine.num_restarts == 3


def test_non_streaming_engine_error_is_a_500_in_openai_shape(live: ServerState) -> None:
    engine = live.served.engine.engine

    def broken_step():
        raise RuntimeError("broken")

    engine.step = broken_step
    client = TestClient(build_app(live), raise_server_exceptions=False)
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 500
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
