"""POST /v1/completions: text or token-id prompts (or a batch of them), n samples each.

Choice indices follow OpenAI: prompt i, sample j is choice ``i * n + j``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from kvserve.engine.request import RequestOutput
from kvserve.server.async_engine import PromptSpec, RequestStream
from kvserve.server.errors import APIError, bad_request
from kvserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from kvserve.server.serving import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    SSE_DONE,
    ClientDisconnected,
    EventStreamResponse,
    Served,
    cached_tokens,
    collect,
    sse,
    stream_events,
    usage,
)
from kvserve.server.tenants import salt_for, tenant_of


def _prompts(served: Served, req: CompletionRequest) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        batch: list = [p]
    elif not p:
        raise bad_request("the prompt is empty", "prompt", "empty_prompt")
    elif isinstance(p[0], int):
        batch = [p]
    else:
        batch = list(p)
    served.check_sequences(len(batch), req.n)  # before tokenizing any of them
    out = []
    total = 0
    for item in batch:
        if isinstance(item, str):
            ids = served.require_tokenizer().encode(item) if item else []
        else:
            ids = list(item)
            served.check_token_ids(ids, "prompt")
        if not ids:
            raise bad_request("the prompt is empty", "prompt", "empty_prompt")
        total += len(ids)
        served.check_prompt_tokens(total)  # stop at the first prompt past the bound
        out.append(ids)
    return out


def _refuse_unsupported(req: CompletionRequest) -> None:
    if req.echo:
        raise bad_request("echo is not supported by kvserve", "echo")
    if req.suffix:
        raise bad_request("suffix is not supported by kvserve", "suffix")
    if req.best_of not in (None, req.n):
        raise bad_request("best_of other than n is not supported by kvserve", "best_of")


def _logprobs(
    served: Served,
    token_ids: list[int],
    steps: list[dict[int, float]],
    text_offset: int,
) -> tuple[CompletionLogprobs, int]:
    """Logprobs of these output tokens: the sampled token's, and the top k plus the sampled
    one (up to k + 1 entries, as OpenAI's legacy completions); and the text offset after
    them."""
    lp = CompletionLogprobs()
    offset = text_offset
    for token, step in zip(token_ids, steps, strict=True):
        text = served.token_text(token)
        lp.tokens.append(text)
        lp.token_logprobs.append(step.get(token))
        lp.top_logprobs.append({served.token_text(t): v for t, v in step.items()})
        lp.text_offset.append(offset)
        offset += len(text)
    return lp, offset


def _prepare(served: Served, req: CompletionRequest) -> tuple[list[list[int]], list[PromptSpec]]:
    """Validate and tokenize: blocking work, run in ``served``'s preprocessing pool."""
    served.check_model(req.model)
    _refuse_unsupported(req)
    prompts = _prompts(served, req)
    specs = []
    for ids in prompts:
        max_tokens = served.resolve_max_tokens(
            req.max_tokens, len(ids), COMPLETIONS_DEFAULT_MAX_TOKENS, "max_tokens", "prompt"
        )
        specs.append(PromptSpec(ids, served.sampling_params(req, max_tokens, req.logprobs)))
    return prompts, specs


async def create_completion(
    served: Served, req: CompletionRequest, request: HTTPRequest
) -> Response:
    prompts, specs = await served.run_blocking(_prepare, served, req)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    stream = served.submit(specs, salt_for(tenant_of(request), req.cache_salt), rid)
    n = req.n
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(served, req, stream, rid, created, [len(p) for p in prompts], include_usage)
        return EventStreamResponse(body, stream)
    try:
        finals = await collect(stream, request)
    except ClientDisconnected:
        return Response(status_code=499)
    choices = []
    for (i, j), out in sorted(finals.items()):
        logprobs = None
        if req.logprobs is not None:  # a final output: the whole lists
            assert out.token_ids is not None and out.logprobs is not None
            logprobs = _logprobs(served, out.token_ids, out.logprobs, 0)[0]
        choices.append(
            CompletionChoice(
                index=i * n + j, text=out.text, logprobs=logprobs, finish_reason=out.finish_reason
            )
        )
    outs = list(finals.values())
    body = CompletionResponse(
        id=rid,
        created=created,
        model=served.model_name,
        choices=choices,
        usage=usage([len(p) for p in prompts], outs, cached_tokens(outs)),
    )
    return JSONResponse(body.model_dump())


async def _stream(
    served: Served,
    req: CompletionRequest,
    stream: RequestStream,
    rid: str,
    created: int,
    prompt_lens: list[int],
    include_usage: bool,
) -> AsyncIterator[str]:
    finals: dict[tuple[int, int], RequestOutput] = {}
    cached = {}  # prompt index -> cached tokens
    text_offsets: dict[tuple[int, int], int] = {}
    try:
        async for event in stream_events(stream):
            out = event.output
            key = (event.prompt_index, out.index)
            if out.index == 0:
                cached[event.prompt_index] = out.num_cached_tokens
            logprobs = None
            if req.logprobs is not None:  # this step's tokens only (a DELTA output)
                assert out.new_logprobs is not None
                logprobs, text_offsets[key] = _logprobs(
                    served, out.new_token_ids, out.new_logprobs, text_offsets.get(key, 0)
                )
            if out.finished:
                finals[key] = out
            if not out.new_text and not out.finished and logprobs is None:
                continue  # nothing a client could see yet (text held back)
            choice = CompletionChoice(
                index=event.prompt_index * req.n + out.index,
                text=out.new_text,
                logprobs=logprobs,
                finish_reason=out.finish_reason,
            )
            chunk = CompletionResponse(
                id=rid, created=created, model=served.model_name, choices=[choice]
            )
            yield sse(chunk.model_dump_json(exclude={"usage"}))
        if include_usage:
            final = CompletionResponse(
                id=rid,
                created=created,
                model=served.model_name,
                choices=[],
                usage=usage(prompt_lens, list(finals.values()), sum(cached.values())),
            )
            yield sse(final.model_dump_json())
    except APIError as e:
        yield e.sse()
    yield SSE_DONE
