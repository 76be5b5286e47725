"""What completions and chat completions share: the model check, prompt and length checks,
request -> SamplingParams, submitting to the engine, waiting with disconnect detection,
usage and logprob formatting.

Handlers validate everything before submitting, so a refusal is always a clean HTTP error
with nothing queued; the engine's own checks stay as a last line of defence.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request as HTTPRequest

from kvserve.engine.limits import RequestLimits, RequestRejected
from kvserve.engine.request import RequestOutput
from kvserve.kv import cache_explain
from kvserve.sampling import RequestOutputKind, SamplingParams
from kvserve.server import bounds
from kvserve.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    ErrorEvent,
    Event,
    OutputEvent,
    PromptSpec,
    QueueFullError,
    RequestStream,
)
from kvserve.server.config import ServerConfig
from kvserve.server.engine_records import WorkerInfo
from kvserve.server.errors import APIError, bad_request
from kvserve.server.prefix_cache_dir import PrefixCacheDir
from kvserve.server.protocol import PromptTokensDetails, Usage, _SamplingRequest
from kvserve.server.stream_drain import (
    EventStreamResponse as EventStreamResponse,  # the routes' SSE
)
from kvserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


T = TypeVar("T")


class ClientDisconnected(Exception):
    pass


@dataclass(slots=True)
class Served:
    """The loaded model as the API sees it."""

    engine: AsyncEngine
    tokenizer: Tokenizer | None
    model_name: str
    limits: RequestLimits  # the engine's own check of a request (thread-safe: frozen data)
    bounds: ServerConfig = field(default_factory=ServerConfig)  # the per-request bounds
    # where tokenizing, templating and validating run, off the event loop (None: asyncio's
    # default executor)
    executor: Executor | None = None
    info: WorkerInfo | None = None  # what /server_info tells a router (server/worker_routes.py)
    # run in order once the engine loop has stopped (the KV events publisher's shutdown)
    closers: list[Callable[[], None]] = field(default_factory=list)
    prefix_cache_dir: PrefixCacheDir | None = None  # --prefix-cache-dir, for POST /save_cache

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    async def run_blocking(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in the preprocessing pool, so the event loop (/health, every other
        client's stream) keeps running meanwhile. Tokenizers release the GIL while they
        work; pure-Python validation yields it every few milliseconds."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args))

    def close(self) -> None:
        self.engine.shutdown()
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        for close in self.closers:
            try:
                close()
            except Exception:  # noqa: BLE001 - one failing closer must not skip the others
                logger.exception("closing %s failed", close)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: send token ids", "prompt")
        return self.tokenizer

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        with rejected_as_400():
            self.limits.check_token_ids(ids, param)

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def cache_info(self, out: RequestOutput) -> dict | None:
        """``return_cache_info``: the prompt's prefix-cache explanation, texts decoded."""
        if out.kv_cache is None:
            return None
        decode = None if self.tokenizer is None else self.token_texts
        return cache_explain.as_dict(out.kv_cache, decode)

    def token_texts(self, token_ids: Sequence[int]) -> str:
        """The text of a token-id prompt, special tokens included (echo shows them)."""
        if self.tokenizer is None:
            return "".join(self.token_text(t) for t in token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    # -- limits and parameters -----------------------------------------------------------
    def check_sequences(self, num_prompts: int, n: int) -> None:
        bounds.check_sequences(self.bounds, num_prompts, n)

    def check_prompt_tokens(self, total: int) -> None:
        bounds.check_prompt_tokens(self.bounds, total)

    def check_stops(self, stop: Sequence[str]) -> None:
        bounds.check_stops(self.bounds, stop)

    def resolve_max_tokens(
        self,
        requested: int | None,
        prompt_len: int,
        default: int | None,
        param: str,
        prompt_param: str,
    ) -> int:
        """``RequestLimits.resolve_max_tokens`` as a 400 naming the field the client sent."""
        with rejected_as_400():
            return self.limits.resolve_max_tokens(
                requested, prompt_len, default, param, prompt_param
            )

    def sampling_params(
        self,
        req: _SamplingRequest,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not s for s in stop):
            raise bad_request("stop strings must not be empty", "stop")
        self.check_stops(stop)
        stop_ids = list(req.stop_token_ids or [])
        if len(stop_ids) > self.bounds.max_stop_strings:  # checked at every token too
            raise bad_request(
                f"{len(stop_ids)} stop token ids were sent; the limit is "
                f"{self.bounds.max_stop_strings} (--max-stop-strings)",
                "stop_token_ids",
            )
        fields = {
            "max_tokens": max_tokens,
            "n": req.n,
            "ignore_eos": req.ignore_eos,
            # streams send each step's delta; a JSON response reads the final output, which
            # carries the whole text and logprobs. Every step's output feeds the latency metrics
            "output_kind": RequestOutputKind.DELTA,
        }
        for name in (
            *("temperature", "top_p", "top_k", "min_p", "seed"),
            *("presence_penalty", "frequency_penalty", "repetition_penalty"),
        ):
            value = getattr(req, name)
            if value is not None:
                fields[name] = value
        try:
            params = SamplingParams(
                **fields,
                stop=tuple(stop),
                stop_token_ids=tuple(stop_ids),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        except (ValueError, TypeError) as e:  # the protocol's ranges should have caught it
            raise bad_request(str(e), str(e).split(" ", 1)[0]) from e
        with rejected_as_400():
            self.limits.check_params(params)
        return params

    # -- running ---------------------------------------------------------------------------
    def submit(
        self, prompts: Sequence[PromptSpec], cache_salt: str | None, request_id: str
    ) -> RequestStream:
        try:
            return self.engine.submit(prompts, cache_salt, request_id)
        except QueueFullError as e:
            raise APIError(503, str(e), code="queue_full", headers={"Retry-After": "1"}) from e
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_dead") from e
        except ValueError as e:  # more sequences than the waiting bound: it never fits
            raise bad_request(str(e), "prompt", "too_many_prompts") from e


@contextmanager
def rejected_as_400() -> Iterator[None]:
    """The engine's ``RequestRejected`` as a 400 naming its field and code."""
    try:
        yield
    except RequestRejected as e:
        raise bad_request(str(e), e.param, e.code) from e


async def _wait_for_disconnect(request: HTTPRequest) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(
    stream: RequestStream, request: HTTPRequest
) -> dict[tuple[int, int], RequestOutput]:
    """Wait for every sample to finish: {(prompt_index, sample_index): final output}.

    A client that goes away meanwhile has its request aborted (blocks freed) and raises
    ClientDisconnected.
    """
    finals: dict[tuple[int, int], RequestOutput] = {}

    async def consume() -> None:
        async for event in stream:
            if isinstance(event, ErrorEvent):
                raise APIError(event.status, event.message)
            if event.output.finished:
                finals[(event.prompt_index, event.output.index)] = event.output

    work = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            raise ClientDisconnected
        work.result()
        return finals
    finally:
        gone.cancel()
        work.cancel()  # no-op once done; matters when this handler itself is cancelled
        stream.abort()  # no-op once finished


async def stream_events(stream: RequestStream) -> AsyncIterator[OutputEvent]:
    """Events of a streaming request; an engine error raises APIError (sent in-band).
    Aborting on disconnect is ``EventStreamResponse``'s job."""
    event: Event
    async for event in stream:
        if isinstance(event, ErrorEvent):
            raise APIError(event.status, event.message)
        yield event


def usage(prompt_lens: Sequence[int], finals: Sequence[RequestOutput], cached: int) -> Usage:
    """Under the StreamingLLM policy (outputs say what they dropped) ``kv_dropped_tokens``."""
    dropped = [o.num_dropped_tokens for o in finals if o.num_dropped_tokens is not None]
    prompt = sum(prompt_lens)
    completion = sum(len(o.token_ids) for o in finals)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        kv_dropped_tokens=sum(dropped) if dropped else None,
    )


def cached_tokens(outputs: Sequence[RequestOutput]) -> int:
    """Prompt tokens served by the prefix cache: counted once per prompt (sample 0 holds it)."""
    return sum(o.num_cached_tokens for o in outputs if o.index == 0)


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"
