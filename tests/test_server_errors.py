"""Every refusal of the server, with its status and OpenAI's error shape, against real
`kvserve serve` processes: 400 (never 422 or 500), 401, 404, 413 and 503 with Retry-After."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from conftest import SERVER_API_KEY
from server_helpers import MAX_MODEL_LEN, ServerProcess, start_server


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    return error


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return server.http().post(path, json=body)


def completion(**fields) -> dict:
    return {"model": "tiny-chat", "prompt": "Hello", "max_tokens": 2, **fields}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"n": 65}, "n"),
        ({"n": 0}, "n"),
        ({"stop": 5}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"stream": "yes"}, "stream"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [1, -3]}, "prompt"),
        ({"prompt": [60000]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": "0.5"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"echo": True, "stream": True}, "echo"),  # echo itself is served (test_server_echo)
        ({"max_tokens": 0, "echo": False}, "max_tokens"),  # 0 only with echo
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"suffix": "and so on"}, "suffix"),
        ({"best_of": 2}, "best_of"),
    ],
)
def test_completion_parameter_errors_are_400(server, fields: dict, param: str) -> None:
    assert_error(post(server, "/v1/completions", completion(**fields)), 400, param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None),
        ({"messages": "hi"}, "messages"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ],
)
def test_chat_parameter_errors_are_400(server, fields: dict, param: str | None) -> None:
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], **fields}
    assert_error(post(server, "/v1/chat/completions", body), 400, param)


def test_malformed_bodies_are_400(server) -> None:
    http = server.http()
    for content in (b"not json", b"[1, 2]", b"", b'{"prompt": "a"'):
        r = http.post(
            "/v1/completions", content=content, headers={"content-type": "application/json"}
        )
        assert_error(r, 400)


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", b'{"prompt": "\\ud800 hi"}', "prompt"),
        ("/v1/completions", b'{"prompt": "' + b"a " * 40 + b'", "cache_salt": "\\ud800"}', None),
        ("/v1/completions", b'{"prompt": "hi", "stop": ["\\udc00"]}', "stop"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', None),
        ("/tokenize", b'{"prompt": "\\udfff"}', "prompt"),
    ],
)
def test_lone_surrogates_are_400_and_the_engine_lives_on(server, path, raw, param) -> None:
    # JSON can escape a lone surrogate; no tokenizer or prefix-cache hash can take one
    r = server.http().post(path, content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400, param)
    assert server.http().get("/health").status_code == 200


def test_prompt_longer_than_the_context_names_both_numbers(server) -> None:
    ids = [100] * (MAX_MODEL_LEN + 5)
    error = assert_error(post(server, "/v1/completions", completion(prompt=ids)), 400, "prompt")
    assert str(MAX_MODEL_LEN + 5) in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    assert error["code"] == "context_length_exceeded"


def test_max_tokens_that_cannot_fit_names_both_numbers(server) -> None:
    body = completion(prompt=[100] * 100, max_tokens=MAX_MODEL_LEN)
    error = assert_error(post(server, "/v1/completions", body), 400, "max_tokens")
    assert "100" in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    # the chat endpoint names the parameter the client used
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6}
    assert_error(post(server, "/v1/chat/completions", chat), 400, "max_completion_tokens")
    long_chat = {"messages": [{"role": "user", "content": "hi " * MAX_MODEL_LEN}]}
    assert_error(post(server, "/v1/chat/completions", long_chat), 400, "messages")


def test_the_openai_client_sees_a_bad_request(server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model="tiny-chat", prompt="hi", temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"


def test_unknown_model_is_404(server) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        server.client().chat.completions.create(
            model="gpt-17", messages=[{"role": "user", "content": "hi"}]
        )
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert_error(post(server, "/tokenize", {"model": "gpt-17", "prompt": "x"}), 404, "model")


ENDPOINTS = [
    ("GET", "/v1/models"),
    ("GET", "/metrics"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/openapi.json"),
    ("GET", "/v1/kv_state"),
]


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
def test_every_endpoint_needs_the_key(server, method: str, path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": SERVER_API_KEY}):
        r = httpx.request(method, server.url + path, headers=headers, json={}, timeout=10)
        assert_error(r, 401)
    ok = httpx.request(method, server.url + path, headers=server.headers, timeout=10)
    assert ok.status_code != 401


def test_health_is_open_without_a_key(server) -> None:
    """Routers and load balancers probe /health with no credentials (SGLang's router does);
    it tells liveness only."""
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(server.url + "/health", headers=headers, timeout=10)
        assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_openai_client_with_a_wrong_key_gets_401(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_body_over_the_limit_is_413(server) -> None:
    body = completion(prompt="x" * (5 << 20))
    assert_error(post(server, "/v1/completions", body), 413)
    # without a Content-Length (chunked) too
    chunks = (b'{"prompt": "' + b"x" * 65536 for _ in range(80))
    r = server.http().post("/v1/completions", content=chunks)
    assert_error(r, 413)


# --------------------------------------------------------------------------------------------
# a server that runs one request at a time and queues one more


@pytest.fixture(scope="module")
def one_at_a_time(chat_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    args = ["--max-num-seqs", "1", "--max-queued-requests", "1"]
    proc = start_server(chat_checkpoint, tmp_path_factory.mktemp("logs1"), *args)
    yield proc
    proc.stop()


def _long_stream(http: httpx.Client):
    body = {"prompt": "Tell me everything", "max_tokens": MAX_MODEL_LEN - 64}
    return http.stream("POST", "/v1/completions", json={**body, "ignore_eos": True, "stream": True})


def test_full_queue_is_503_and_a_queued_disconnect_frees_its_place(one_at_a_time) -> None:
    server = one_at_a_time
    with server.http() as a, server.http() as b, _long_stream(a) as running:
        first = running.iter_lines()
        assert next(first).startswith("data:")  # it runs
        with _long_stream(b) as queued:
            assert queued.status_code == 200
            server.wait_for("vllm:num_requests_waiting", 1)
            r = post(server, "/v1/completions", completion())
            error = assert_error(r, 503)  # the queue holds one, and one waits
            assert error["type"] == "server_error" and r.headers["retry-after"] == "1"
        # the queued client went away: its place is free again
        m = server.wait_for("vllm:num_requests_waiting", 0)
        assert m["vllm:num_requests_running"] == 1, (m, server.log()[-3000:])
    m = server.wait_idle()
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    ok = post(server, "/v1/completions", completion())
    assert ok.status_code == 200, ok.text
    # a batch larger than the whole bound could never be queued: a 400 naming the bound
    # (an empty queue used to take it, holding every other client out while it ran)
    batch = post(server, "/v1/completions", completion(prompt=["one", "two", "three"]))
    error = assert_error(batch, 400)
    assert error["code"] == "too_many_prompts" and "--max-queued-requests" in error["message"]
    assert "3 sequences" in error["message"], error
