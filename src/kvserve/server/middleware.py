"""Pure ASGI middleware: the API key check (and the caller's tenant and role) and the request
body size limit.

Both answer before any route runs, in OpenAI's error shape. Being plain ASGI (not Starlette's
BaseHTTPMiddleware) they do not buffer responses, so streams pass through untouched.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.errors import APIError
from kvserve.server.tenants import ADMIN_SCOPE_KEY, SCOPE_KEY, ApiKey

# answered without a key: a liveness verdict only, no data. Load balancers and routers probe it
# without credentials (SGLang's router does; so do Kubernetes probes), as vLLM leaves it open
OPEN_PATHS = frozenset({"/health"})
_WHITESPACE = b" \t"  # RFC 7230's OWS and RWS are spaces and horizontal tabs


class AuthorizationError(ValueError):
    """The Authorization header is malformed (not merely a wrong key): a 400."""


def bearer_credentials(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the request's ``Authorization: Bearer TOKEN`` header (RFC 7235, RFC 6750):
    the scheme in any case, one or more spaces or tabs before the token, surrounding
    whitespace ignored. None when there is no header or it names another scheme (a 401).

    Several Authorization headers are taken only when they say the same thing: SGLang's router
    forwards its client's header and adds its own (with the same key in `kvserve cluster`).
    Headers that differ raise ``AuthorizationError`` (a 400): RFC 7230 section 3.2.2 allows
    one such field, and which one a proxy in front checked is anyone's guess, so neither the
    first nor the last may win."""
    values = {
        value.strip(_WHITESPACE) for name, value in headers if name.lower() == b"authorization"
    }
    if len(values) > 1:
        raise AuthorizationError(
            f"send one Authorization header, got {len(values)} different ones: which of them "
            "holds the key is ambiguous"
        )
    if not values:
        return None
    value = values.pop()
    end = next((i for i, c in enumerate(value) if c in _WHITESPACE), len(value))
    scheme, token = value[:end], value[end:].lstrip(_WHITESPACE)
    if scheme.lower() != b"bearer" or not token:
        return None
    return token


class APIKeyMiddleware:
    """Every path but ``open_paths`` (default ``OPEN_PATHS``; the app adds the web view's
    static page, server/web_view.py) needs ``Authorization: Bearer KEY`` with a known key; the
    key's tenant and role go into the scope (``tenants.SCOPE_KEY``, ``ADMIN_SCOPE_KEY``). Keys
    are compared as sha256 digests, every one of them in constant time whatever matched: the
    time taken tells neither which key came close nor how long the keys are."""

    def __init__(
        self, app: ASGIApp, keys: Mapping[str, ApiKey], open_paths: frozenset[str] = OPEN_PATHS
    ) -> None:
        if not keys:
            raise ValueError("APIKeyMiddleware needs at least one key")
        self.app = app
        self.open_paths = open_paths
        self.keys = [(hashlib.sha256(k.key.encode()).digest(), k) for k in keys.values()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        try:
            token = bearer_credentials(scope["headers"])
        except AuthorizationError as e:
            error = APIError(400, str(e), code="invalid_authorization_header")
            return await error.response()(scope, receive, send)
        given = hashlib.sha256(token or b"").digest()
        found = None
        for digest, key in self.keys:
            if hmac.compare_digest(given, digest):
                found = key
        if token is None or found is None:
            error = APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            return await error.response()(scope, receive, send)
        scope[SCOPE_KEY] = found.tenant
        scope[ADMIN_SCOPE_KEY] = found.admin
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
