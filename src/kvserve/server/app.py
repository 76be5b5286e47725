"""The FastAPI application: routes over a ``ServerState``; no torch here.

The app exists before the model has loaded: until ``state.served`` is set, /health and the
model routes answer 503 with Retry-After, so a supervisor can start the process and poll.
"""

from __future__ import annotations

import importlib.metadata
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvserve.server.body_check import BodyCheckMiddleware, new_checker_pool
from kvserve.server.chat import chat_prompt, create_chat_completion
from kvserve.server.completions import create_completion
from kvserve.server.config import ServerConfig
from kvserve.server.errors import APIError, bad_request, install_error_handlers
from kvserve.server.metrics import CONTENT_TYPE, ServerMetrics
from kvserve.server.middleware import OPEN_PATHS, APIKeyMiddleware, BodyLimitMiddleware
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from kvserve.server.serving import Served
from kvserve.server.web_view import WEB_VIEW_PATHS, add_web_view_routes
from kvserve.server.worker_routes import add_worker_routes

VERSION = importlib.metadata.version("kvserve")


@dataclass(slots=True)
class ServerState:
    config: ServerConfig
    model_name: str
    metrics: ServerMetrics
    served: Served | None = None  # None while loading
    started: int = field(default_factory=lambda: int(time.time()))
    # big generation bodies are parsed here first (body_check.py); its worker starts on use
    body_check_pool: Executor = field(default_factory=new_checker_pool)


def new_state(config: ServerConfig, model_name: str) -> ServerState:
    """A state with no model yet; its metrics read whatever engine it holds at scrape time."""
    metrics = ServerMetrics(
        model_name, lambda: None if state.served is None else state.served.engine.stats()
    )
    state = ServerState(config, model_name, metrics)
    return state


_ERRORS = {
    code: {"model": ErrorResponse, "description": desc}
    for code, desc in [
        (400, "invalid request"),
        (401, "missing or wrong API key"),
        (403, "an admin route (/flush_cache, /save_cache) called with a tenant's key"),
        (404, "unknown model"),
        (413, "body too large"),
        (503, "loading, queue full or engine stopped"),
    ]
}


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="kvserve", version=VERSION, responses=_ERRORS)
    app.state.kvserve = state
    install_error_handlers(app)
    # added last = outermost: the key is checked before the body is read, the body's size
    # before it is parsed
    app.add_middleware(BodyCheckMiddleware, config=state.config, pool=state.body_check_pool)
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.config.max_body_bytes)
    if keys := state.config.tenant_keys:
        # the web view's page and assets hold no data: they load without a key, then ask
        app.add_middleware(APIKeyMiddleware, keys=keys, open_paths=OPEN_PATHS | WEB_VIEW_PATHS)

    def served() -> Served:
        if state.served is None:
            raise APIError(
                503, "the model is still loading", code="loading", headers={"Retry-After": "5"}
            )
        return state.served

    # GET and HEAD (probes send either): {"status": "ok"} 200, else 503 with the status
    # (loading | wedged | dead) beside the error in OpenAI's shape; HEAD: the same, no body
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request) -> Response:
        if state.served is None:
            status, error = "loading", APIError(503, "the model is still loading", code="loading")
        else:
            verdict = state.served.engine.health()
            status = verdict.state.value  # ok | wedged | dead
            error = None if verdict.ok else APIError(503, verdict.message, code=f"engine_{status}")
        head = request.method == "HEAD"
        if error is None:
            return Response(status_code=200) if head else JSONResponse({"status": status})
        retry = {"Retry-After": "5"}
        if head:
            return Response(status_code=503, headers=retry)
        return JSONResponse({"status": status, **error.body().model_dump()}, 503, headers=retry)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        s = served()
        card = ModelCard(
            id=s.model_name, created=state.started, root=s.model_name, max_model_len=s.max_model_len
        )
        return ModelList(data=[card])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(served(), body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(served(), body, request)

    def tokenize_blocking(s: Served, body: TokenizeRequest) -> TokenizeResponse:
        s.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            ids = chat_prompt(s, body.messages, body.add_generation_prompt)
        else:
            ids = s.require_tokenizer().encode(body.prompt, body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=s.max_model_len, tokens=ids)

    def detokenize_blocking(s: Served, body: DetokenizeRequest) -> DetokenizeResponse:
        s.check_model(body.model)
        s.check_token_ids(body.tokens, "tokens")
        return DetokenizeResponse(prompt=s.require_tokenizer().decode(body.tokens))

    # tokenizing runs in the preprocessing pool: the event loop keeps answering meanwhile
    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        s = served()
        return await s.run_blocking(tokenize_blocking, s, body)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        s = served()
        return await s.run_blocking(detokenize_blocking, s, body)

    @app.get("/tokenizer_info", response_model=TokenizerInfoResponse)
    async def tokenizer_info() -> TokenizerInfoResponse:
        s = served()
        if s.tokenizer is None:
            raise APIError(404, "this model has no tokenizer", code="tokenizer_not_found")
        hf = s.tokenizer.hf

        def special(name: str) -> str | None:
            value = getattr(hf, name, None)
            return None if value is None else str(value)

        template = getattr(hf, "chat_template", None)
        return TokenizerInfoResponse(
            tokenizer_class=type(hf).__name__,
            bos_token=special("bos_token"),
            eos_token=special("eos_token"),
            pad_token=special("pad_token"),
            unk_token=special("unk_token"),
            model_max_length=s.max_model_len,
            vocab_size=len(hf),
            chat_template=template if isinstance(template, str) else None,
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": VERSION})

    add_worker_routes(app, served)  # what routers ask a replica (SGLang's router, llm-d)
    add_web_view_routes(app, served)  # / and its assets, GET /v1/kv_state

    return app
