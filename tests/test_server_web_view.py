"""The web view's routes in process (Starlette's TestClient) on the tiny chat checkpoint: the
page and its assets load without the API key (and only they do), ``/v1/kv_state`` needs the
key, and its JSON has the schema and the pool's exact state after real requests."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import kvserve.server
from kvserve.config import CacheConfig, EngineConfig
from kvserve.server.app import build_app, new_state
from kvserve.server.config import ServerConfig
from kvserve.server.launch import load_served

KEY = "web-view-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NUM_BLOCKS = 64
BLOCK = 16  # the server's default block size
STATIC = Path(kvserve.server.__file__).parent / "static"
ASSETS = [
    ("/", "index.html", "text/html"),
    ("/static/app.js", "app.js", "text/javascript"),
    ("/static/style.css", "style.css", "text/css"),
]


@pytest.fixture(scope="module")
def client(chat_checkpoint: Path):
    state = new_state(ServerConfig(api_key=KEY), "tiny-chat")
    engine = EngineConfig(
        model=str(chat_checkpoint), enforce_eager=True, cache=CacheConfig(num_blocks=NUM_BLOCKS)
    )
    state.served = load_served(engine, state.config, "tiny-chat", state.metrics)
    yield TestClient(build_app(state))
    state.served.close()


@pytest.mark.parametrize(("path", "name", "media"), ASSETS)
def test_the_page_and_its_assets_load_without_a_key(client, path, name, media) -> None:
    r = client.get(path)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith(media)
    assert r.content == (STATIC / name).read_bytes()  # the files shipped in the package
    assert r.headers["content-security-policy"].startswith("default-src 'self';")
    assert b"http://" not in r.content and b"https://" not in r.content  # nothing from elsewhere


def test_the_page_loads_while_the_model_is_still_loading() -> None:
    app = build_app(new_state(ServerConfig(api_key=KEY), "tiny-chat"))
    assert TestClient(app).get("/").status_code == 200


def test_only_the_page_is_open(client) -> None:
    for path in ("/v1/kv_state", "/static/", "/static/app.js.map", "/index.html", "/v1/models"):
        r = client.get(path)
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/kv_state", headers={"Authorization": "Bearer wrong"}).status_code == 401


def complete(client: TestClient, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    r = client.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_kv_state_has_the_schema_and_the_pools_state(client) -> None:
    r = client.get("/v1/kv_state", headers=AUTH)
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    state = r.json()
    assert set(state) == {
        "model", "max_model_len", "spec", "num_blocks", "blocks", "requests", "block_requests",
        "stats", "latency", "cache_dtypes",
    }  # fmt: skip
    assert state["model"] == "tiny-chat" and state["max_model_len"] == 2048
    spec = state["spec"]
    itemsize = {"float32": 4, "bfloat16": 2}[spec["cache_dtype"]]  # "auto": the model's dtype
    # the tiny chat llama: 2 layers, 4 KV heads of 64 / 4 = 16 values
    assert (spec["num_layers"], spec["num_kv_heads"], spec["head_dim"]) == (2, 4, 16)
    assert spec["bytes_per_token"] == 2 * 4 * (16 * itemsize + 16 * itemsize)
    assert spec["block_size"] == BLOCK
    assert spec["bytes_per_block"] == BLOCK * spec["bytes_per_token"]
    assert state["num_blocks"] == NUM_BLOCKS and state["blocks"] == [0] * NUM_BLOCKS
    assert state["requests"] == [] and state["block_requests"] == {}
    assert set(state["stats"]) == {
        "num_running", "num_waiting", "num_free_blocks", "num_used_blocks", "num_cached_blocks",
        "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate",
        "num_preemptions",
    }  # fmt: skip
    assert state["stats"]["prefix_cache_hit_rate"] is None
    assert state["latency"]["num_ttft"] == 0 and state["latency"]["ttft_median_s"] is None
    # bytes per token and head at head dim 128: 34 (int8) and 18 (int4_sym) per 32 values
    assert state["cache_dtypes"]["int8"]["128"] == 136
    assert state["cache_dtypes"]["int4_sym"]["128"] == 72

    prompt = list(range(100, 140))  # 40 tokens
    assert complete(client, prompt, 5)["prompt_tokens_details"]["cached_tokens"] == 0
    after = client.get("/v1/kv_state", headers=AUTH).json()
    # 40 + 5 tokens, 44 computed: 2 full blocks stay cached, evictable; nothing in use
    assert [after["blocks"].count(s) for s in (0, 1, 2)] == [NUM_BLOCKS - 2, 0, 2]
    assert after["requests"] == [] and after["block_requests"] == {}
    assert complete(client, prompt, 5)["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK
    stats = client.get("/v1/kv_state", headers=AUTH).json()["stats"]
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (80, 32)
    assert stats["prefix_cache_hit_rate"] == 0.4
    latency = client.get("/v1/kv_state", headers=AUTH).json()["latency"]
    assert (latency["num_ttft"], latency["num_tpot"], latency["window"]) == (2, 2, 64)
    assert latency["ttft_median_s"] > 0 and latency["tpot_median_s"] > 0
