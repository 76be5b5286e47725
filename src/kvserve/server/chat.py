"""POST /v1/chat/completions: messages through the model's chat template, n samples.

Streaming follows OpenAI: per choice, a first chunk with ``delta.role``, then content deltas,
then a chunk with ``finish_reason``; with ``stream_options.include_usage`` a last chunk with
empty choices and the usage. A request with neither ``max_tokens`` nor
``max_completion_tokens`` generates at most ``--default-chat-max-tokens`` (512) tokens, fewer
when the context has less room left.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError

from kvserve.engine.request import RequestOutput
from kvserve.sampling import SamplingParams
from kvserve.server.async_engine import PromptSpec, RequestStream
from kvserve.server.errors import APIError, bad_request
from kvserve.server.prompt_logprobs import vllm_prompt_logprobs
from kvserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
)
from kvserve.server.serving import (
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


def chat_prompt(
    served: Served, messages: list[ChatMessage], add_generation_prompt: bool = True
) -> list[int]:
    """Prompt ids for a conversation, through the model's own chat template."""
    tok = served.require_tokenizer()
    if not tok.has_chat_template:
        raise bad_request("this model has no chat template: use /v1/completions", "messages")
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        return tok.apply_chat_template(conversation, add_generation_prompt)
    except (TemplateError, ValueError) as e:  # e.g. a template that insists on alternating roles
        raise bad_request(f"the chat template refused these messages: {e}", "messages") from e


def _logprobs(
    served: Served, token_ids: list[int], steps: list[dict[int, float]] | None, k: int
) -> ChatLogprobs:
    """These output tokens' logprobs, each with its top k."""
    assert steps is not None, "a request with logprobs has them on every output"
    content = []
    for token, step in zip(token_ids, steps, strict=True):
        text = served.token_text(token)
        tops = [
            TopLogprob(token=(t := served.token_text(i)), logprob=v, bytes=list(t.encode()))
            for i, v in list(step.items())[:k]
        ]
        content.append(
            TokenLogprob(
                token=text, logprob=step[token], bytes=list(text.encode()), top_logprobs=tops
            )
        )
    return ChatLogprobs(content=content)


def _prepare(served: Served, req: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
    """Validate and template: blocking work, run in ``served``'s preprocessing pool."""
    served.check_model(req.model)
    if req.tools:
        raise bad_request("tools are not supported by kvserve", "tools")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    served.check_sequences(1, req.n)
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request(
            "prompt_logprobs are not available when stream is true", "prompt_logprobs"
        )
    ids = chat_prompt(served, req.messages, req.add_generation_prompt)
    served.check_prompt_tokens(len(ids))
    requested, param = req.max_completion_tokens, "max_completion_tokens"
    if requested is None:
        requested, param = req.max_tokens, "max_tokens"
    default = served.bounds.default_chat_max_tokens  # --default-chat-max-tokens
    max_tokens = served.resolve_max_tokens(requested, len(ids), default, param, "messages")
    k = (req.top_logprobs or 0) if req.logprobs else None
    return ids, served.sampling_params(req, max_tokens, k, req.prompt_logprobs)


async def create_chat_completion(
    served: Served, req: ChatCompletionRequest, request: HTTPRequest
) -> Response:
    ids, params = await served.run_blocking(_prepare, served, req)
    k = (req.top_logprobs or 0) if req.logprobs else None
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    stream = served.submit(
        [PromptSpec(ids, params, req.return_cache_info, tenant_of(request))],
        salt_for(tenant_of(request), req.cache_salt),
        rid,
    )
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(served, req, stream, rid, created, len(ids), include_usage)
        return EventStreamResponse(body, stream)
    try:
        finals = await collect(stream, request)
    except ClientDisconnected:
        return Response(status_code=499)
    # final outputs: the whole text and logprobs
    choices = [
        ChatChoice(
            index=j,
            message=AssistantMessage(content=out.text),
            logprobs=None if k is None else _logprobs(served, out.token_ids, out.logprobs, k),
            finish_reason=out.finish_reason,
        )
        for (_, j), out in sorted(finals.items())
    ]
    outs = list(finals.values())
    body = ChatCompletionResponse(
        id=rid,
        created=created,
        model=served.model_name,
        choices=choices,
        usage=usage([len(ids)], outs, cached_tokens(outs)),
        prompt_logprobs=None
        if req.prompt_logprobs is None
        else vllm_prompt_logprobs(served, finals[(0, 0)], req.prompt_logprobs),
        kv_cache=served.cache_info(finals[(0, 0)]) if req.return_cache_info else None,
    )
    return JSONResponse(body.model_dump())


async def _stream(
    served: Served,
    req: ChatCompletionRequest,
    stream: RequestStream,
    rid: str,
    created: int,
    prompt_len: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    k = (req.top_logprobs or 0) if req.logprobs else None

    def chunk(choice: ChatChunkChoice) -> str:
        c = ChatCompletionChunk(id=rid, created=created, model=served.model_name, choices=[choice])
        body = c.model_dump(exclude={"usage"})
        for d in body["choices"]:  # OpenAI sends "delta": {} at the end, not nulls
            d["delta"] = {k: v for k, v in d["delta"].items() if v is not None}
        return sse(json.dumps(body))

    finals: list[RequestOutput] = []
    cached = 0
    try:
        # the role first, for every choice, before any content (as OpenAI does)
        for j in range(req.n):
            yield chunk(ChatChunkChoice(index=j, delta=DeltaMessage(role="assistant", content="")))
        async for event in stream_events(stream):
            out = event.output
            if out.index == 0:
                cached = out.num_cached_tokens
            # a DELTA output: this step's tokens only
            logprobs = (
                None if k is None else _logprobs(served, out.new_token_ids, out.new_logprobs, k)
            )
            if out.new_text or (logprobs is not None and logprobs.content):
                delta = DeltaMessage(content=out.new_text)
                yield chunk(ChatChunkChoice(index=out.index, delta=delta, logprobs=logprobs))
            if out.finished:
                finals.append(out)
                yield chunk(
                    ChatChunkChoice(
                        index=out.index, delta=DeltaMessage(), finish_reason=out.finish_reason
                    )
                )
        if include_usage:
            final = ChatCompletionChunk(
                id=rid,
                created=created,
                model=served.model_name,
                choices=[],
                usage=usage([prompt_len], finals, cached),
            )
            yield sse(final.model_dump_json())
    except APIError as e:
        yield e.sse()
    yield SSE_DONE
