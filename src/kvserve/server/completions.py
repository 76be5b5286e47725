"""POST /v1/completions: text or token-id prompts (or a batch of them), n samples each.

Choice indices follow OpenAI: prompt i, sample j is choice ``i * n + j``.

``echo`` puts the prompt before the completion: its text, and with ``logprobs`` its tokens'
logprobs (server/prompt_logprobs.py). ``max_tokens: 0`` (echo only) returns the prompt
alone: as vLLM, the engine then runs the prefill with max_tokens = 1 and the one sampled
token is dropped. Echo is not streamed (a 400 names ``echo``).
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
from kvserve.server.prompt_logprobs import echo_logprobs, vllm_prompt_logprobs
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


def _prompts(served: Served, req: CompletionRequest) -> list[tuple[list[int], str | None]]:
    """Each prompt's ids, and its text when it came as text."""
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
        out.append((ids, item if isinstance(item, str) else None))
    return out


def _refuse_unsupported(req: CompletionRequest) -> None:
    if req.echo and req.stream:
        raise bad_request(
            "echo with stream is not supported by kvserve; send stream: false", "echo"
        )
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request(
            "prompt_logprobs are not available when stream is true", "prompt_logprobs"
        )
    if req.max_tokens == 0 and not req.echo:
        raise bad_request(
            "max_tokens must be at least 1 (0 is allowed only with echo: true)", "max_tokens"
        )
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


def _prepare(
    served: Served, req: CompletionRequest, tenant: str | None
) -> tuple[list[tuple[list[int], str | None]], list[PromptSpec]]:
    """Validate and tokenize: blocking work, run in ``served``'s preprocessing pool."""
    served.check_model(req.model)
    _refuse_unsupported(req)
    prompts = _prompts(served, req)
    # max_tokens 0 (echo): one token is generated for the prefill to run, then dropped
    requested = 1 if req.max_tokens == 0 else req.max_tokens
    # echo + logprobs needs the prompt's logprobs too (vLLM's rule); the engine computes the
    # larger k, each part of the response takes its own
    prompt_k = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_k = max(req.logprobs, prompt_k or 0)
    specs = []
    for ids, _ in prompts:
        max_tokens = served.resolve_max_tokens(
            requested, len(ids), COMPLETIONS_DEFAULT_MAX_TOKENS, "max_tokens", "prompt"
        )
        params = served.sampling_params(req, max_tokens, req.logprobs, prompt_k)
        specs.append(PromptSpec(ids, params, req.return_cache_info, tenant))
    return prompts, specs


async def create_completion(
    served: Served, req: CompletionRequest, request: HTTPRequest
) -> Response:
    prompts, specs = await served.run_blocking(_prepare, served, req, tenant_of(request))
    prompt_lens = [len(ids) for ids, _ in prompts]
    prompt_only = req.max_tokens == 0  # echo alone: the one generated token is dropped
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    stream = served.submit(specs, salt_for(tenant_of(request), req.cache_salt), rid)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(served, req, stream, rid, created, prompt_lens, include_usage)
        return EventStreamResponse(body, stream)
    try:
        finals = await collect(stream, request)
    except ClientDisconnected:
        return Response(status_code=499)
    choices = [
        _choice(served, req, prompts[i], i * req.n + j, out)
        for (i, j), out in sorted(finals.items())
    ]
    outs = list(finals.values())
    total = usage(prompt_lens, outs, cached_tokens(outs))
    if prompt_only:  # the dropped tokens were never completion
        total.completion_tokens, total.total_tokens = 0, total.prompt_tokens
    body = CompletionResponse(
        id=rid, created=created, model=served.model_name, choices=choices, usage=total
    )
    return JSONResponse(body.model_dump())


def _choice(
    served: Served,
    req: CompletionRequest,
    prompt: tuple[list[int], str | None],
    index: int,
    out: RequestOutput,
) -> CompletionChoice:
    """One choice from a final output (the whole lists), with the echoed prompt first."""
    assert out.token_ids is not None and out.text is not None
    token_ids, text, finish_reason = out.token_ids, out.text, out.finish_reason
    if req.max_tokens == 0:  # echo only: drop the token generated for the prefill
        token_ids, text, finish_reason = [], "", "length"
    logprobs = None
    if req.echo:
        ids, prompt_text = prompt
        if prompt_text is None:  # token ids: their text, special tokens included (as vLLM)
            prompt_text = served.token_texts(ids)
        text = prompt_text + text
        if req.logprobs is not None:
            assert out.prompt_logprobs is not None
            logprobs, offset = echo_logprobs(served, ids, out.prompt_logprobs, req.logprobs)
            assert out.logprobs is not None
            generated = _logprobs(served, token_ids, out.logprobs[: len(token_ids)], offset)[0]
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(logprobs, name).extend(getattr(generated, name))
    elif req.logprobs is not None:
        assert out.logprobs is not None
        logprobs = _logprobs(served, token_ids, out.logprobs, 0)[0]
    return CompletionChoice(
        index=index,
        text=text,
        logprobs=logprobs,
        finish_reason=finish_reason,
        prompt_logprobs=None
        if req.prompt_logprobs is None
        else vllm_prompt_logprobs(served, out, req.prompt_logprobs),
        kv_cache=served.cache_info(out) if req.return_cache_info else None,
    )


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
