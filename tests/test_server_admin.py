"""Admin scope and the Authorization header (server/tenants.py, server/middleware.py): tenant
keys get 403 on the routes that act on every tenant (/flush_cache, /save_cache) and see only
their own request ids in /v1/kv_state; admin keys (the --api-key, an --api-keys line marked
``admin``) do everything; a server without keys stays open. The header is parsed as RFC 7235
says (scheme in any case, one header only). In process, on the tiny chat checkpoint."""

from __future__ import annotations

import asyncio
import hmac
import threading
from pathlib import Path

import httpx
import pytest
from conftest import random_token_ids
from fastapi.testclient import TestClient
from starlette.types import Receive, Scope, Send

import kvserve.server.middleware as middleware
import kvserve.server.web_view as web_view
from kvserve.config import CacheConfig, EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.kv import persist
from kvserve.sampling import SamplingParams
from kvserve.server.app import build_app, new_state
from kvserve.server.config import ServerConfig
from kvserve.server.kv_state import OTHER_TENANTS, build_kv_state
from kvserve.server.launch import load_served
from kvserve.server.middleware import APIKeyMiddleware, AuthorizationError, bearer_credentials
from kvserve.server.tenants import (
    ADMIN_SCOPE_KEY,
    SCOPE_KEY,
    ApiKey,
    salt_for,
    tenant_keys,
    tenant_of_salt,
)

OPERATOR = "operator-key"  # --api-key: tenant "default", admin
KEYS = (
    ApiKey("alpha-admin", "alpha", admin=True),
    ApiKey("alpha-1", "alpha"),
    ApiKey("beta-1", "beta"),
)
ADMIN_ROUTES = [("POST", "/flush_cache"), ("GET", "/flush_cache"), ("POST", "/save_cache")]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def state(chat_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    cache_dir = tmp_path_factory.mktemp("admin") / "cache"
    config = ServerConfig(api_key=OPERATOR, api_keys=KEYS, prefix_cache_dir=str(cache_dir))
    state = new_state(config, "tiny-chat")
    engine = EngineConfig(
        model=str(chat_checkpoint), enforce_eager=True, cache=CacheConfig(num_blocks=64)
    )
    state.served = load_served(engine, config, "tiny-chat", state.metrics)
    yield state
    state.served.close()


@pytest.fixture(scope="module")
def client(state):
    return TestClient(build_app(state))


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
def test_tenant_keys_get_403_on_admin_routes(client, method: str, path: str) -> None:
    for key in ("alpha-1", "beta-1"):
        r = client.request(method, path, headers=auth(key))
        assert r.status_code == 403, (key, r.text)
        error = r.json()["error"]
        assert error["code"] == "permission_denied" and error["type"] == "permission_error"
        assert error["message"].startswith(f"{path} acts on every tenant's cache")
    for key in (OPERATOR, "alpha-admin"):  # the operator's key and a file's admin line
        r = client.request(method, path, headers=auth(key))
        assert r.status_code == 200, (key, r.text)
        assert r.json()["success"] is True
    assert client.request(method, path).status_code == 401  # no key at all: still a 401


def test_a_server_without_keys_stays_open(state) -> None:
    open_state = new_state(ServerConfig(), "tiny-chat")
    open_state.served = state.served  # the same engine behind a keyless app
    c = TestClient(build_app(open_state))
    for method, path in ADMIN_ROUTES:
        assert c.request(method, path).status_code == 200, path


def test_kv_state_shows_a_tenant_its_own_requests_only(client, monkeypatch) -> None:
    viewers = []

    def spy(*args, **kwargs):
        viewers.append(args[4] if len(args) > 4 else kwargs.get("viewer"))
        return build_kv_state(*args, **kwargs)

    monkeypatch.setattr(web_view, "build_kv_state", spy)
    for key in ("alpha-1", "beta-1", "alpha-admin", OPERATOR):
        assert client.get("/v1/kv_state", headers=auth(key)).status_code == 200
    assert viewers == ["alpha", "beta", None, None]  # None: every request id


def test_kv_state_hides_other_tenants_request_ids(state) -> None:
    """On the engine: alpha's view names alpha's request and lumps beta's two (which share a
    cached prefix block) under one anonymous holder; the block states are the same for all."""
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    beta_salt = salt_for("beta", None)
    prefix = random_token_ids(40, seed=3, vocab_size=1000)

    def on_loop(engine: LLMEngine):
        engine.add_request(prefix + [7], greedy, request_id="beta-0", cache_salt=beta_salt)
        while engine.has_unfinished_requests():
            engine.step()
        engine.add_request(
            random_token_ids(20, seed=4, vocab_size=1000),
            greedy,
            request_id="a1",
            cache_salt=salt_for("alpha", "x"),
        )
        engine.add_request(prefix + [8], greedy, request_id="b1", cache_salt=beta_salt)
        engine.add_request(prefix + [9], greedy, request_id="b2", cache_salt=beta_salt)
        engine.step()
        views = {v: build_kv_state(engine, "m", viewer=v) for v in (None, "alpha", "beta", "gamma")}
        while engine.has_unfinished_requests():
            engine.step()
        return views

    views = asyncio.run(state.served.engine.call(on_loop))
    full = views[None]
    assert full.requests == ["a1", "b1", "b2"]
    shared = [b for b, holders in full.block_requests.items() if holders == [1, 2]]
    assert len(shared) == 2  # b1 and b2 share the 32 cached prefix tokens: 2 blocks of 16
    for viewer, names in [
        ("alpha", ["a1", OTHER_TENANTS]),
        ("beta", [OTHER_TENANTS, "b1", "b2"]),
        ("gamma", [OTHER_TENANTS]),
    ]:
        view = views[viewer]
        assert view.requests == names and view.blocks == full.blocks
        rename = {
            i: names.index(r if r in names else OTHER_TENANTS) for i, r in enumerate(full.requests)
        }
        expected = {b: sorted({rename[i] for i in h}) for b, h in full.block_requests.items()}
        assert view.block_requests == expected
    assert views["alpha"].block_requests[shared[0]] == [1]  # two hidden holders, one entry


def test_tenant_of_salt_inverts_salt_for() -> None:
    for tenant, salt in [("a", None), ("a", "x"), ('b"[', '["c", null]')]:
        assert tenant_of_salt(salt_for(tenant, salt)) == tenant
    assert tenant_of_salt(None) is None and tenant_of_salt("plain") is None
    assert tenant_of_salt("[1, 2]") is None and tenant_of_salt("[not json") is None


def test_concurrent_saves_hold_one_copy_and_the_rest_get_409(state, monkeypatch) -> None:
    live, peak, started = [0], [0], threading.Event()
    release = threading.Event()
    snapshot, write = LLMEngine.snapshot_prefix_cache, persist.write

    def counting_snapshot(engine):
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        return snapshot(engine)

    def slow_write(*args):
        started.set()
        assert release.wait(10)
        try:
            return write(*args)
        finally:
            live[0] -= 1

    monkeypatch.setattr(LLMEngine, "snapshot_prefix_cache", counting_snapshot)
    monkeypatch.setattr(persist, "write", slow_write)
    app = build_app(state)

    async def four_saves() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            first = asyncio.create_task(c.post("/save_cache", headers=auth(OPERATOR)))
            await asyncio.to_thread(started.wait, 10)  # the first holds its copy now
            rest = [c.post("/save_cache", headers=auth(OPERATOR)) for _ in range(3)]
            others = await asyncio.gather(*rest)
            release.set()
            return [await first, *others]

    responses = asyncio.run(four_saves())
    assert [r.status_code for r in responses] == [200, 409, 409, 409]
    error = responses[1].json()["error"]
    assert error["code"] == "save_in_progress" and responses[1].headers["retry-after"] == "5"
    assert peak[0] == 1 and live[0] == 0
    # the lock is free again: the next save runs
    assert TestClient(app).post("/save_cache", headers=auth(OPERATOR)).status_code == 200
    assert peak[0] == 1


# -- the Authorization header ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "token"),
    [
        (b"Bearer k1", b"k1"),
        (b"bearer k1", b"k1"),
        (b"BEARER k1", b"k1"),
        (b"bEaReR k1", b"k1"),
        (b"Bearer   k1", b"k1"),  # 1*SP between scheme and token
        (b"Bearer \t k1", b"k1"),
        (b"  Bearer k1 \t", b"k1"),  # surrounding OWS
        (b"Bearer", None),
        (b"Bearer   ", None),
        (b"Basic k1", None),
        (b"Bearerk1", None),
        (b"", None),
        (b"Bearer k1 k2", b"k1 k2"),  # not a token68: compared whole, so never a key
    ],
)
def test_bearer_credentials(value: bytes, token: bytes | None) -> None:
    assert bearer_credentials([(b"host", b"x"), (b"authorization", value)]) == token


def test_two_different_authorization_headers_are_a_400() -> None:
    with pytest.raises(AuthorizationError, match="one Authorization header, got 2 different"):
        bearer_credentials([(b"authorization", b"Bearer a"), (b"authorization", b"Bearer b")])
    assert bearer_credentials([(b"host", b"x")]) is None
    # the same header twice (SGLang's router forwards its client's and adds its own) is one
    same = [(b"authorization", b"Bearer a"), (b"Authorization", b"Bearer a ")]
    assert bearer_credentials(same) == b"a"


@pytest.fixture
def guarded() -> TestClient:
    seen = {}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.update(tenant=scope[SCOPE_KEY], admin=scope[ADMIN_SCOPE_KEY])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    client = TestClient(APIKeyMiddleware(app, tenant_keys(OPERATOR, KEYS)))
    client.seen = seen  # type: ignore[attr-defined]
    return client


def test_the_middleware_accepts_any_case_and_refuses_two_headers(guarded, monkeypatch) -> None:
    for header, tenant, admin in [
        ("bearer beta-1", "beta", False),
        ("BEARER alpha-admin", "alpha", True),
        ("Bearer  " + OPERATOR, "default", True),
    ]:
        r = guarded.get("/x", headers={"Authorization": header})
        assert r.status_code == 200 and guarded.seen == {"tenant": tenant, "admin": admin}
    for header in ("Basic beta-1", "Bearer beta-2", "Bearer beta-1x", "beta-1"):
        r = guarded.get("/x", headers={"Authorization": header})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    for pair in (["Bearer beta-1", "Bearer wrong"], ["Bearer wrong", "Bearer beta-1"]):
        # the last one no longer wins, nor the first: two different ones are refused
        r = guarded.get("/x", headers=[("Authorization", v) for v in pair])
        assert r.status_code == 400, pair
        assert r.json()["error"]["code"] == "invalid_authorization_header"
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append(len(a))
        return real(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", counting)
    for header in ("Bearer beta-1", "Bearer wrong", "Bearer " + "x" * 500):
        calls.clear()
        guarded.get("/x", headers={"Authorization": header})
        assert calls == [32] * 4  # every key compared, as equal-length digests, whatever matched
