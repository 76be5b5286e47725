"""A loaded model with its tokenizer, and the single-sequence jobs the CLI runs on it:
one generation, a multi-turn chat that reuses its cache, and the cache-vs-no-cache check."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvserve.engine.limits import RequestLimits
from kvserve.generation import GenerationResult, generate
from kvserve.models.config import ModelConfig
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import load_model
from kvserve.models.weight_formats import WeightsReport
from kvserve.platform import default_device
from kvserve.reference import DenseCacheDecoder, NoCacheDecoder
from kvserve.sampling import SamplingParams
from kvserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelSession:
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None
    path: Path
    weights: WeightsReport | None = None

    @classmethod
    def open(
        cls,
        model: str | Path | None = None,
        dtype: str = "auto",
        device: str | None = None,
        show_progress: bool = False,
        quantization: str | None = None,
    ) -> ModelSession:
        """``dtype`` "auto": bfloat16 on CUDA and native-bf16 CPUs, else float32."""
        loaded = load_model(
            model,
            dtype,
            device or default_device(),
            show_progress=show_progress,
            quantization=quantization,
        )
        try:
            tokenizer = Tokenizer.load(loaded.path, loaded.gguf_file)
        except ValueError as e:
            logger.warning("no tokenizer (%s); only --prompt-ids prompts will work", e)
            tokenizer = None
        return cls(loaded.config, loaded.model, tokenizer, loaded.path, loaded.weights)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = list(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(dict.fromkeys(ids))

    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"{self.path} has no tokenizer: pass token ids instead of text")
        return self.tokenizer

    def encode_prompt(self, text: str, chat: bool = False) -> list[int]:
        tok = self.require_tokenizer()
        if chat:
            return tok.apply_chat_template([{"role": "user", "content": text}])
        return tok.encode(text)

    def check_prompt(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """The engine's check (``RequestLimits``) for the reference decoders' dense cache."""
        limits = RequestLimits.dense(
            self.config.vocab_size, self.config.max_model_len, self.tokenizer is not None
        )
        limits.check(prompt_ids, params)


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
