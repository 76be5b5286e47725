"""A chat completion that sends neither max_tokens nor max_completion_tokens generates at most
--default-chat-max-tokens (512) tokens, fewer when the context has less room left; it once
ran to the end of the context (693 tokens from a 135M model that never stopped).
/v1/completions keeps OpenAI's and vLLM's 16. Tested in-process on the tiny chat model with
ignore_eos, so every request runs to its limit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvserve import cli
from kvserve.config import EngineConfig, SchedulerConfig
from kvserve.serve_args import server_config
from kvserve.server.app import ServerState, build_app, new_state
from kvserve.server.config import ServerConfig
from kvserve.server.launch import load_served

MAX_MODEL_LEN = 64
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def live(chat_checkpoint: Path):
    state = new_state(ServerConfig(default_chat_max_tokens=6), "tiny-chat")
    engine = EngineConfig(
        model=str(chat_checkpoint),
        enforce_eager=True,
        scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN),
    )
    state.served = load_served(engine, state.config, "tiny-chat", state.metrics)
    yield state
    state.served.engine.shutdown()


def chat(client: TestClient, **fields) -> dict:
    body = {"messages": MESSAGES, "ignore_eos": True, "temperature": 0, **fields}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_without_a_limit_stops_at_the_default(live: ServerState) -> None:
    client = TestClient(build_app(live))
    r = chat(client)
    assert r["usage"]["completion_tokens"] == 6
    assert r["choices"][0]["finish_reason"] == "length"
    # what the client sends wins, either spelling
    assert chat(client, max_tokens=3)["usage"]["completion_tokens"] == 3
    assert chat(client, max_completion_tokens=9)["usage"]["completion_tokens"] == 9


def test_the_default_is_capped_by_the_room_left(live: ServerState) -> None:
    served = live.served
    served.bounds = dataclasses.replace(served.bounds, default_chat_max_tokens=512)
    try:
        r = chat(TestClient(build_app(live)))
    finally:
        served.bounds = dataclasses.replace(served.bounds, default_chat_max_tokens=6)
    prompt = r["usage"]["prompt_tokens"]
    assert 0 < prompt < MAX_MODEL_LEN
    assert r["usage"]["completion_tokens"] == MAX_MODEL_LEN - prompt


def test_completions_keep_openais_default_of_16(live: ServerState) -> None:
    client = TestClient(build_app(live))
    r = client.post("/v1/completions", json={"prompt": "Hi", "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


def test_the_flag_and_its_bounds() -> None:
    assert ServerConfig().default_chat_max_tokens == 512
    args = cli.build_parser().parse_args(["serve", "--default-chat-max-tokens", "9"])
    assert server_config(args).default_chat_max_tokens == 9
    assert server_config(cli.build_parser().parse_args(["serve"])).default_chat_max_tokens == 512
    with pytest.raises(ValueError, match=r"^default_chat_max_tokens must be >= 1, got 0$"):
        ServerConfig(default_chat_max_tokens=0)
