"""Tenants (--api-keys): each key's tenant has a prefix cache of its own, whatever cache_salt
its clients send; keys of one tenant share. Against a real `kvserve serve` process."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import ServerProcess, cached_prefix_tokens, start_server

from kvserve.config import CacheConfig
from kvserve.server.tenants import ApiKey, parse_api_keys, salt_for, tenant_keys

SINGLE_KEY = "single-key"  # --api-key: the "default" tenant
KEYS = {"alpha-1": "alpha", "alpha-2": "alpha", "beta-1": "beta"}
SYSTEM = "You are a careful assistant. " + " ".join(f"rule{i}" for i in range(100))


@pytest.fixture(scope="module")
def tenant_server(chat_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("tenants")
    keys_file = tmp / "keys.txt"
    lines = ["# key tenant", ""] + [f"{k}  {t}" for k, t in KEYS.items()]
    keys_file.write_text("\n".join(lines) + "\n")
    proc = start_server(chat_checkpoint, tmp, "--api-keys", str(keys_file), api_key=SINGLE_KEY)
    yield proc
    proc.stop()


def ask(server: ServerProcess, key: str, question: str, salt: str | None = None) -> int:
    """Cached prompt tokens of one chat request under this key."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    extra = {} if salt is None else {"cache_salt": salt}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    r = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=1, extra_body=extra
    )
    return r.usage.prompt_tokens_details.cached_tokens


def shared_blocks(server: ServerProcess, a: str, b: str) -> int:
    """Tokens of the whole blocks that b's prompt shares with a's."""

    def ids(question: str) -> list[int]:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        return server.http().post("/tokenize", json={"messages": messages}).json()["tokens"]

    return cached_prefix_tokens(ids(a), ids(b), CacheConfig().block_size)


def test_tenants_never_share_and_keys_of_one_tenant_do(tenant_server: ServerProcess) -> None:
    s = tenant_server
    hit = shared_blocks(s, "First question?", "Second question?")
    assert hit >= 150
    assert ask(s, "alpha-1", "First question?") == 0
    assert ask(s, "alpha-1", "First question?", salt="team-x") == 0  # a salt subdivides
    # beta tries everything alpha sent, and alpha's own salt spelled as the server does
    assert ask(s, "beta-1", "Second question?") == 0
    assert ask(s, "beta-1", "Second question?", salt="team-x") == 0
    assert ask(s, "beta-1", "Third question?", salt=salt_for("alpha", None)) == 0
    assert ask(s, "beta-1", "Third question?", salt=salt_for("alpha", "team-x")) == 0
    assert ask(s, SINGLE_KEY, "Second question?") == 0  # the single key: its own tenant
    # another key of alpha's shares alpha's blocks, salted and unsalted
    assert ask(s, "alpha-2", "Second question?") == hit
    assert ask(s, "alpha-2", "Second question?", salt="team-x") == hit
    # and beta shares with itself
    assert ask(s, "beta-1", "First question?") == shared_blocks(
        s, "Second question?", "First question?"
    )
    # the global counters keep vLLM's names and count every tenant's hits
    m = s.metrics()
    assert m["vllm:prefix_cache_hits_total"] == 3 * hit


def test_unknown_key_is_refused(tenant_server: ServerProcess) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Bearer alpha-"}):
        r = httpx.get(f"{tenant_server.url}/v1/models", headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    for key in [*KEYS, SINGLE_KEY]:
        r = httpx.get(f"{tenant_server.url}/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200


def test_parse_api_keys() -> None:
    lines = ["# comment", "", "k1 alice", "  k2\tbob  "]
    assert parse_api_keys(lines) == (ApiKey("k1", "alice", False), ApiKey("k2", "bob", False))
    assert parse_api_keys(["k1 a admin"]) == (ApiKey("k1", "a", True),)
    with pytest.raises(ValueError, match="line 2: expected 'KEY TENANT'"):
        parse_api_keys(["k1 a", "k2"])
    with pytest.raises(ValueError, match="line 2: the third field.*'admin', got 'c'"):
        parse_api_keys(["k1 a", "k2 b c"])
    with pytest.raises(ValueError, match="line 2: expected 'KEY TENANT'.*4 field"):
        parse_api_keys(["k1 a", "k2 b admin d"])
    with pytest.raises(ValueError, match="line 2: this key is already listed"):
        parse_api_keys(["k1 a", "k1 b"])
    with pytest.raises(ValueError, match="lists no key"):
        parse_api_keys(["# nothing"])
    assert tenant_keys("solo", [ApiKey("k1", "a")]) == {
        "k1": ApiKey("k1", "a", False),
        "solo": ApiKey("solo", "default", True),  # the operator's key is an admin's
    }
    with pytest.raises(ValueError, match="also listed"):
        tenant_keys("k1", [ApiKey("k1", "a")])


def test_salts_are_distinct_per_tenant() -> None:
    assert salt_for(None, "x") == "x" and salt_for(None, None) is None  # no tenants: vLLM's
    pairs = [("a", None), ("a", "x"), ("b", None), ("b", "x"), ("a", '"x'), ('a"', "x")]
    assert len({salt_for(t, c) for t, c in pairs}) == len(pairs)
