"""Big generation bodies are checked in a side process before the event loop parses them.

Parsing JSON and validating it with pydantic hold the GIL: a 2 MiB body of token ids takes
about a second, during which no other client (not even /health) is answered, and a worker
thread would not help. So a body of at least ``min_bytes`` to /v1/completions or
/v1/chat/completions first goes to a one-process pool, which parses and validates it and
applies the per-request bounds (``bounds.py``). A body that fails there is refused with the
400 the route would have given, and the event loop never parses it; one that passes is
replayed to the route, which parses it again -- now bounded by the same limits (at most
``max_prompts_per_request`` prompts and ``max_prompt_tokens_per_request`` token ids).
Small bodies skip the round trip: parsing them costs less than it.

Every JSON POST body, to any route and of any size, is first measured for nesting depth
(``bounds.check_json_depth``, ``--max-json-depth``) before anything parses it: json's and
pydantic's parsers recurse per level, and a deep body made them raise RecursionError (a 500
with a traceback from here, a bare 400 from FastAPI).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import threading
import time
from concurrent.futures import Executor, ProcessPoolExecutor

from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server import bounds
from kvserve.server.config import ServerConfig
from kvserve.server.errors import APIError, validation_message
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest

MIN_CHECKED_BYTES = 64 << 10  # below this, parsing on the loop costs well under a millisecond
_MODELS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}
Refusal = tuple[int, str, str | None, str | None]  # status, message, param, code


def precheck(path: str, raw: bytes, config: ServerConfig) -> Refusal | None:
    """In the side process: the refusal this body gets, or None to hand it to the route.

    The same steps as FastAPI's parse and the route's first checks, in their order: the
    nesting depth, JSON, the pydantic model, then the bounds that need no tokenizer. Other
    routes' bodies get the depth check alone."""
    refusal = depth_refusal(raw, config)
    if refusal is not None or path not in _MODELS:
        return refusal
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return 400, "the request body is not valid JSON", None, "invalid_value"
    try:
        req = _MODELS[path].model_validate(data)
    except ValidationError as e:
        errors = [
            {**err, "loc": ("body", *err["loc"])}
            for err in e.errors(include_url=False, include_context=False)
        ]
        message, param = validation_message(errors)
        return 400, message, param, "invalid_value"
    try:
        if isinstance(req, CompletionRequest):
            p = req.prompt
            batch = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
            bounds.check_sequences(config, len(batch), req.n)
            tokens = sum(len(item) for item in batch if isinstance(item, list))
            bounds.check_prompt_tokens(config, tokens)
        else:
            bounds.check_sequences(config, 1, req.n)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        bounds.check_stops(config, stop)
    except APIError as e:
        return e.status, e.message, e.param, e.code
    return None


def depth_refusal(raw: bytes, config: ServerConfig) -> Refusal | None:
    try:
        bounds.check_json_depth(config, raw)
    except APIError as e:
        return e.status, e.message, e.param, e.code
    return None


def _exit_with_parent(parent_pid: int) -> None:
    """The worker's initializer: exit when the server process is gone. A pool worker holds
    both ends of its own call queue, so it would never see the parent's end close, and a
    server killed without its shutdown would leave it waiting forever."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="kvserve-parent-watch", daemon=True).start()


def new_checker_pool() -> Executor:
    """One worker, started by spawn (the server process has threads; fork would copy their
    locks), on first use; it exits with the server whichever way the server ends."""
    return ProcessPoolExecutor(
        1,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_exit_with_parent,
        initargs=(os.getpid(),),
    )


class BodyCheckMiddleware:
    """Pure ASGI: every JSON POST body's depth checked, big ones (with the generation
    routes' checks) through ``precheck`` in ``pool``."""

    def __init__(
        self,
        app: ASGIApp,
        config: ServerConfig,
        pool: Executor,
        min_bytes: int = MIN_CHECKED_BYTES,
    ) -> None:
        self.app = app
        self.config = config
        self.pool = pool
        self.min_bytes = min_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        # FastAPI reads a body with no content type as JSON too
        content_type = dict(scope["headers"]).get(b"content-type", b"json")
        if b"json" not in content_type:
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        while True:  # the body limit (an outer middleware) keeps this bounded
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending it all
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        if len(raw) >= self.min_bytes:
            loop = asyncio.get_running_loop()
            refusal = await loop.run_in_executor(
                self.pool, precheck, scope["path"], raw, self.config
            )
        else:  # at most a few milliseconds on the loop
            refusal = depth_refusal(raw, self.config)
        if refusal is not None:
            status, text, param, code = refusal
            return await APIError(status, text, param, code).response()(scope, receive, send)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
