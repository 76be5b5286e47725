"""Prefix-miss explanations: each cause on the bookkeeping alone, the lessons' case (a system
prompt whose timestamp changes) on the default model's real tokenizer and chat template, and
the opt-in ``kv_cache`` field of the HTTP API."""

from __future__ import annotations

import pytest
from conftest import finish, make_request, prefill, random_token_ids

from kvserve.engine.llm import LLM
from kvserve.kv.cache_explain import as_dict
from kvserve.kv.manager import KVCacheManager
from kvserve.models.model_session import ModelSession
from kvserve.sampling import SamplingParams

BS = 4  # conftest's kv fixture block size


def cached(kv: KVCacheManager, tokens: list[int], salt: str | None = None) -> None:
    req = make_request(f"warm-{len(kv.pool.cached)}", tokens, salt)
    prefill(kv, req)
    finish(kv, req)


def why(kv: KVCacheManager, tokens: list[int], salt: str | None = None):
    req = make_request("asker", tokens, salt)
    _, num_hit = kv.get_computed_blocks(req)
    return kv.explain(req, num_hit)


def test_each_cause(kv: KVCacheManager) -> None:
    base = list(range(100, 116))  # 16 tokens: 4 full blocks
    cached(kv, base)
    # the same 12 tokens then a change at position 13 (block 3, offset 1)
    changed = base[:13] + [999] + base[14:] + [42]  # 17: block 3 may be served
    e = why(kv, changed)
    assert (e.cause, e.cached_tokens, e.diverged_at) == ("content", 12, 13)
    assert e.window_start == 13 - 8
    assert e.new_token_ids == tuple(changed[5:21])  # as far as the prompt goes
    assert e.cached_token_ids == tuple(base[5:16])  # up to the cached block's end
    # a change inside the first block
    e = why(kv, [100, 777] + base[2:])
    assert (e.cause, e.cached_tokens, e.diverged_at) == ("content", 0, 1)
    # the same tokens under another salt share nothing: the salt is named
    e = why(kv, base + [5], salt="tenant-b")
    assert (e.cause, e.cached_tokens, e.diverged_at) == ("salt", 0, None)
    # a cached first block under another salt is no "content" match for this salt
    cached(kv, [1, 2, 3, 4, 5, 6, 7, 8], salt="tenant-c")
    assert why(kv, [1, 2, 9, 9, 9], salt=None).cause == "no_cached_prefix"
    # the whole cached prefix hits; 2 more tokens fill no block
    e = why(kv, base + [7, 8])
    assert (e.cause, e.cached_tokens, e.computed_tokens) == ("partial_block", 16, 2)
    # a prompt of whole blocks: the last block holds the last token, always computed
    e = why(kv, base)
    assert (e.cause, e.cached_tokens) == ("hit", 12)
    # nothing cached continues past the cached prefix
    e = why(kv, base + list(range(500, 510)))
    assert (e.cause, e.cached_tokens) == ("no_cached_prefix", 16)
    assert why(kv, random_token_ids(9, seed=5)).cause == "no_cached_prefix"
    d = as_dict(why(kv, changed), lambda ids: " ".join(map(str, ids)))
    assert d["cause"] == "content" and d["diverged_at"] == 13 and "999" in d["new_text"]
    assert d["computed_tokens"] == 17 - 12 and "same salt" in d["reason"]


def test_caching_off_says_so() -> None:
    kv = KVCacheManager(16, BS, enable_prefix_caching=False)
    req = make_request("r", list(range(10)))
    assert kv.explain(req, 0).cause == "caching_off"


@pytest.fixture(scope="module")
def smol(default_gguf) -> ModelSession:
    return ModelSession.open(default_gguf, "float32", "cpu")


def test_the_lessons_timestamp_case(smol: ModelSession) -> None:
    # "a system prompt with a timestamp that changes": the explanation names its position
    tok = smol.require_tokenizer()

    def chat(stamp: str) -> list[int]:
        system = f"You are a helpful assistant. The current time is 2026-12-01 {stamp} UTC."
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Hi!"}]
        return tok.apply_chat_template(msgs)

    first, second = chat("10:15:03"), chat("10:15:04")
    at = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert "4" in tok.decode(second[at : at + 1])  # the token where the seconds differ
    llm = LLM(session=smol, block_size=4, num_kv_blocks=64, enforce_eager=True)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    (warm,) = llm.generate([first], params, use_tqdm=False, explain_cache=True)
    assert warm.kv_cache.cause == "no_cached_prefix" and warm.kv_cache.cached_tokens == 0
    (out,) = llm.generate([second], params, use_tqdm=False, explain_cache=True)
    e = out.kv_cache
    assert e.cause == "content" and e.diverged_at == at
    assert e.cached_tokens == at // 4 * 4 == out.num_cached_tokens
    d = as_dict(e, tok.decode)
    assert "03" in d["cached_text"] and "04" in d["new_text"]
    (plain,) = llm.generate([second], params, use_tqdm=False)
    assert plain.kv_cache is None  # opt-in only


def test_api_return_cache_info(server) -> None:
    import httpx

    url, headers = server.url, server.headers
    body = {
        "prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
        "max_tokens": 1,
        "return_cache_info": True,
        "cache_salt": "explain-test",
    }
    first = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60).json()
    assert first["choices"][0]["kv_cache"]["cause"] == "no_cached_prefix"
    body["prompt"] = body["prompt"][:10] + [999] + body["prompt"][11:]
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60).json()
    info = r["choices"][0]["kv_cache"]
    assert info["cause"] == "content" and info["diverged_at"] == 10
    assert info["cached_tokens"] == r["usage"]["prompt_tokens_details"]["cached_tokens"]
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}
    plain = httpx.post(f"{url}/v1/chat/completions", json=chat, headers=headers, timeout=60)
    assert plain.json()["kv_cache"] is None
    chat["return_cache_info"] = True
    asked = httpx.post(f"{url}/v1/chat/completions", json=chat, headers=headers, timeout=60)
    assert asked.json()["kv_cache"]["prompt_tokens"] == asked.json()["usage"]["prompt_tokens"]
