"""Two things people trip on, in-process: a request whose body is empty or not a JSON object
is a 400 that says so (it once said "missing required parameter: None"), and /health answers
GET and HEAD with the same status, GET with a small JSON body: {"status": "ok"}, or while
loading / wedged / dead 503 with the status beside the error in OpenAI's shape."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from kvserve.server.app import ServerState, build_app, new_state
from kvserve.server.config import ServerConfig
from kvserve.server.engine_records import Health, HealthStatus

CHAT_EXAMPLE = '{"messages": [{"role": "user", "content": "Hello"}]}'
HOW = "send a JSON object with Content-Type: application/json, e.g. "


@pytest.fixture
def loading() -> TestClient:
    return TestClient(build_app(new_state(ServerConfig(), "tiny-chat")))


@pytest.mark.parametrize(
    ("path", "example"),
    [
        ("/v1/completions", '{"prompt": "Hello"}'),
        ("/v1/chat/completions", CHAT_EXAMPLE),
        ("/tokenize", '{"prompt": "Hello"}'),
        ("/detokenize", '{"tokens": [1, 2, 3]}'),
    ],
)
def test_an_empty_body_is_a_400_that_says_the_body_is_empty(
    loading: TestClient, path: str, example: str
) -> None:
    for headers in ({}, {"content-type": "application/json"}):
        r = loading.post(path, content=b"", headers=headers)
        assert r.status_code == 400
        assert r.json()["error"] == {
            "message": f"the request body is empty; {HOW}{example}",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_value",
        }


@pytest.mark.parametrize(
    ("body", "content_type", "message"),
    [
        (b"null", "application/json", f"the request body must be a JSON object, got null; {HOW}"),
        (b"[1, 2]", "application/json", f"the request body must be a JSON object, got [1, 2]; {HOW}"),
        (b'"hi"', "application/json", f'the request body must be a JSON object, got "hi"; {HOW}'),
        (b'{"messages": []}', "text/plain", f"the request body was not sent as JSON; {HOW}"),
    ],
)  # fmt: skip
def test_a_body_that_is_not_a_json_object_says_what_it_is(
    loading: TestClient, body: bytes, content_type: str, message: str
) -> None:
    r = loading.post("/v1/chat/completions", content=body, headers={"content-type": content_type})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == message + CHAT_EXAMPLE


def test_a_missing_field_still_names_it(loading: TestClient) -> None:
    r = loading.post("/v1/chat/completions", json={})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "missing required parameter: messages"
    assert r.json()["error"]["param"] == "messages"


def test_health_while_loading_is_503_for_get_and_head(loading: TestClient) -> None:
    r = loading.get("/health")
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json() == {
        "status": "loading",
        "error": {
            "message": "the model is still loading",
            "type": "server_error",
            "param": None,
            "code": "loading",
        },
    }
    head = loading.head("/health")
    assert head.status_code == 503 and head.headers["retry-after"] == "5"
    assert head.content == b""


class FakeLoop:
    """The one thing /health asks of the engine loop: its verdict."""

    def __init__(self) -> None:
        self.verdict = HealthStatus(Health.OK)

    def health(self) -> HealthStatus:
        return self.verdict


@pytest.fixture
def live() -> ServerState:
    state = new_state(ServerConfig(), "tiny-chat")
    state.served = SimpleNamespace(engine=FakeLoop())  # type: ignore[assignment]
    return state


def test_health_when_serving_is_200_with_a_json_status(live: ServerState) -> None:
    client = TestClient(build_app(live))
    r = client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert r.headers["content-type"] == "application/json"
    head = client.head("/health")
    assert head.status_code == 200 and head.content == b""


def test_health_of_a_dead_or_wedged_loop_says_which(live: ServerState) -> None:
    client = TestClient(build_app(live))
    for state in (Health.DEAD, Health.WEDGED):
        live.served.engine.verdict = HealthStatus(state, f"simulated: {state.value}")
        r = client.get("/health")
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json() == {
            "status": state.value,
            "error": {
                "message": f"simulated: {state.value}",
                "type": "server_error",
                "param": None,
                "code": f"engine_{state.value}",
            },
        }
        assert client.head("/health").status_code == 503
