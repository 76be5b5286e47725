"""What completions and chat completions share: the model check, prompt and length checks,
request -> SamplingParams, submitting to the engine, waiting with disconnect detection,
usage and logprob formatting.

Handlers validate everything before submitting, so a refusal is always a clean HTTP error
with nothing queued; the engine's own checks stay as a last line of defence.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvserve.engine.request import RequestOutput
from kvserve.sampling import RequestOutputKind, SamplingParams
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
from kvserve.server.errors import APIError, bad_request
from kvserve.server.protocol import PromptTokensDetails, Usage, _SamplingRequest
from kvserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


class ClientDisconnected(Exception):
    pass


@dataclass(slots=True)
class Served:
    """The loaded model as the API sees it."""

    engine: AsyncEngine
    tokenizer: Tokenizer | None
    model_name: str
    max_model_len: int
    vocab_size: int
    max_tokens_in_pool: int  # the whole KV pool, in tokens: no request can outgrow it

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
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param
            )

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_texts(self, token_ids: Sequence[int]) -> str:
        """The text of a token-id prompt, special tokens included (echo shows them)."""
        if self.tokenizer is None:
            return "".join(self.token_text(t) for t in token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    # -- limits and parameters -----------------------------------------------------------
    def resolve_max_tokens(
        self,
        requested: int | None,
        prompt_len: int,
        default: int | None,
        param: str,
        prompt_param: str,
    ) -> int:
        """The request's max_tokens, refused with both numbers when it cannot fit; when not
        given, ``default`` (None: all the room left, as vLLM's chat). ``param`` and
        ``prompt_param`` name the fields the client sent, for the error."""
        limit = min(self.max_model_len, self.max_tokens_in_pool)
        what = (
            f"this model's maximum context length is {limit} tokens"
            if limit == self.max_model_len
            else f"this server's KV cache holds at most {limit} tokens per request"
        )
        if prompt_len == 0:
            raise bad_request("the prompt is empty", prompt_param, "empty_prompt")
        if prompt_len >= limit:
            raise bad_request(
                f"the prompt is {prompt_len} tokens, but {what} (room is needed for at least "
                "one generated token)",
                prompt_param,
                "context_length_exceeded",
            )
        room = limit - prompt_len
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise bad_request(
                f"{what}, but {prompt_len + requested} tokens were requested ({prompt_len} in the prompt, {requested} for the completion); "
                f"lower {param} to at most {room}",
                param,
                "context_length_exceeded",
            )
        return requested

    def sampling_params(
        self,
        req: _SamplingRequest,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name) not in (None, 0, 0.0):
                raise bad_request(f"{name} is not supported by kvserve; send 0 or omit it", name)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not s for s in stop):
            raise bad_request("stop strings must not be empty", "stop")
        if stop and self.tokenizer is None:
            raise bad_request("stop strings need a tokenizer; use stop_token_ids", "stop")
        stop_ids = list(req.stop_token_ids or [])
        self.check_token_ids(stop_ids, "stop_token_ids")
        fields = {
            "max_tokens": max_tokens,
            "n": req.n,
            "ignore_eos": req.ignore_eos,
            # streams send each step's delta; a JSON response reads the final output, which
            # carries the whole text and logprobs. Every step's output feeds the latency metrics
            "output_kind": RequestOutputKind.DELTA,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "seed"):
            value = getattr(req, name)
            if value is not None:
                fields[name] = value
        try:
            return SamplingParams(
                **fields,
                stop=tuple(stop),
                stop_token_ids=tuple(stop_ids),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        except (ValueError, TypeError) as e:  # the protocol's ranges should have caught it
            raise bad_request(str(e), str(e).split(" ", 1)[0]) from e

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


class EventStreamResponse(StreamingResponse):
    """SSE over an engine stream that aborts the request however the response ends: also
    when the client leaves before the body generator ever started (its ``finally`` would
    then never run)."""

    def __init__(self, body: AsyncIterator[str], stream: RequestStream) -> None:
        super().__init__(body, media_type="text/event-stream")
        self.engine_stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.engine_stream.abort()  # no-op once finished


def usage(prompt_lens: Sequence[int], finals: Sequence[RequestOutput], cached: int) -> Usage:
    prompt = sum(prompt_lens)
    completion = sum(len(o.token_ids) for o in finals)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def cached_tokens(outputs: Sequence[RequestOutput]) -> int:
    """Prompt tokens served by the prefix cache: counted once per prompt (sample 0 holds it)."""
    return sum(o.num_cached_tokens for o in outputs if o.index == 0)


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"
