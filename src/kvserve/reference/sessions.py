"""The single-sequence jobs the CLI runs on a loaded model over the reference decoders: one
generation, and a multi-turn chat that reuses its dense cache."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from kvserve.models.model_session import ModelSession
from kvserve.reference.decoders import DenseCacheDecoder, NoCacheDecoder
from kvserve.reference.generation import GenerationResult, generate
from kvserve.sampling import SamplingParams


def generate_once(
    session: ModelSession,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    no_cache: bool = False,
    on_text: Callable[[str], None] | None = None,
    keep_logits: bool = False,
) -> GenerationResult:
    session.check_prompt(prompt_ids, params)
    max_len = len(prompt_ids) + params.max_tokens
    decoder = (
        NoCacheDecoder(session.model) if no_cache else DenseCacheDecoder(session.model, max_len)
    )
    return generate(
        decoder,
        prompt_ids,
        params,
        eos_token_ids=session.eos_token_ids,
        tokenizer=session.tokenizer,
        on_text=on_text,
        max_len=max_len,
        keep_logits=keep_logits,
    )


@dataclass(slots=True)
class Conversation:
    """Chat messages plus the dense cache that holds the conversation's tokens so far."""

    decoder: DenseCacheDecoder
    messages: list[dict[str, str]] = field(default_factory=list)


@dataclass(slots=True)
class ChatTurn:
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    completion_tokens: int
    cache_tokens: int
    text: str


def new_conversation(session: ModelSession, system: str | None, max_len: int) -> Conversation:
    max_len = min(max_len, session.config.max_model_len)
    messages = [{"role": "system", "content": system}] if system else []
    return Conversation(DenseCacheDecoder(session.model, max_len), messages)


def chat_turn(
    session: ModelSession,
    conv: Conversation,
    user_text: str,
    params: SamplingParams,
    on_text: Callable[[str], None] | None = None,
) -> ChatTurn:
    """Add a user message, generate the reply; the prompt's common prefix with the cache is reused."""
    tok = session.require_tokenizer()
    messages = [*conv.messages, {"role": "user", "content": user_text}]
    prompt = tok.apply_chat_template(messages)
    max_len = conv.decoder.max_len
    if len(prompt) >= max_len:
        raise ValueError(
            f"the conversation ({len(prompt)} tokens) no longer fits the cache of {max_len} tokens"
        )
    params = _fit_max_tokens(params, max_len - len(prompt))
    result = generate(
        conv.decoder,
        prompt,
        params,
        eos_token_ids=session.eos_token_ids,
        tokenizer=tok,
        on_text=on_text,
        max_len=max_len,
    )
    conv.messages = [*messages, {"role": "assistant", "content": result.text}]
    counters = conv.decoder.counters
    return ChatTurn(
        prompt_tokens=len(prompt),
        reused_tokens=counters.reused_tokens,
        computed_tokens=counters.computed_tokens,
        completion_tokens=result.completion_tokens,
        cache_tokens=len(conv.decoder.tokens),
        text=result.text,
    )


def _fit_max_tokens(params: SamplingParams, room: int) -> SamplingParams:
    return params if params.max_tokens <= room else replace(params, max_tokens=room)
