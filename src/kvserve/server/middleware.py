"""Pure ASGI middleware: the API key check (and the caller's tenant) and the request body size limit.

Both answer before any route runs, in OpenAI's error shape. Being plain ASGI (not Starlette's
BaseHTTPMiddleware) they do not buffer responses, so streams pass through untouched.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.errors import APIError
from kvserve.server.tenants import SCOPE_KEY

# answered without a key: a liveness verdict only, no data. Load balancers and routers probe it
# without credentials (SGLang's router does; so do Kubernetes probes), as vLLM leaves it open
OPEN_PATHS = frozenset({"/health"})


class APIKeyMiddleware:
    """Every path but ``open_paths`` (default ``OPEN_PATHS``; the app adds the web view's
    static page, server/web_view.py) needs ``Authorization: Bearer KEY`` with a known key; the
    key's tenant goes into the scope (``tenants.SCOPE_KEY``). Every key is compared, in
    constant time, whatever matched: the time taken does not tell which key came close."""

    def __init__(
        self, app: ASGIApp, keys: Mapping[str, str], open_paths: frozenset[str] = OPEN_PATHS
    ) -> None:
        if not keys:
            raise ValueError("APIKeyMiddleware needs at least one key")
        self.app = app
        self.open_paths = open_paths
        self.keys = [(f"Bearer {key}".encode(), tenant) for key, tenant in keys.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        tenant = None
        for expected, name in self.keys:
            if hmac.compare_digest(given, expected):
                tenant = name
        if tenant is None:
            error = APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            return await error.response()(scope, receive, send)
        scope[SCOPE_KEY] = tenant
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuse bodies over ``max_bytes`` with 413: by Content-Length when given, else while
    reading (the body is then buffered, which the limit keeps small, and replayed)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body is larger than the limit of {self.max_bytes} bytes",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = self.max_bytes + 1
            if declared > self.max_bytes:
                return await self._too_large().response()(scope, receive, send)
            return await self.app(scope, receive, send)
        # no Content-Length (chunked): read it all, within the limit, then replay it
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._too_large().response()(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
