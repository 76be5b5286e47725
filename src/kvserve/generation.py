"""The single-sequence generation loop over a reference decoder: sample, stream, stop.

Used by ``kvserve verify`` and the tests. Stops on an EOS id (unless ignore_eos), a stop token
id, a stop string (the text is cut before it), ``max_tokens``, or a full cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvserve.reference import DecodeCounters
from kvserve.sampling import SamplingParams, make_generator, sample, top_logprobs
from kvserve.tokenizer import IncrementalDetokenizer, Tokenizer


class Decoder(Protocol):
    counters: DecodeCounters

    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor: ...

    def decode(self, token_id: int) -> torch.Tensor: ...


@dataclass(slots=True)
class GenerationResult:
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    reused_tokens: int  # prompt tokens whose K/V came from the cache
    kv_projections: int  # tokens whose K/V were computed, prefill and decode together
    ttft_s: float  # prefill + first sample
    decode_s: float  # everything after the first token
    logprobs: list[dict[int, float]] | None = None
    step_logits: list[torch.Tensor] = field(default_factory=list)  # only with keep_logits

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens over the whole request time (prefill included)."""
        total = self.ttft_s + self.decode_s
        return self.completion_tokens / total if total > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over the decode time: 1 / time per output token."""
        n = self.completion_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Index where the earliest stop string starts in text, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


def generate(
    decoder: Decoder,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    eos_token_ids: Sequence[int] = (),
    tokenizer: Tokenizer | None = None,
    on_text: Callable[[str], None] | None = None,
    max_len: int | None = None,
    keep_logits: bool = False,
) -> GenerationResult:
    """Generate up to ``params.max_tokens`` tokens after ``prompt_ids``.

    ``on_text`` receives text deltas as they become final (text that might still turn out to
    begin a stop string is held back). ``max_len`` is the decoder's capacity in positions.
    """
    if params.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids.update(eos_token_ids)
    generator = make_generator(params.seed)
    detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
    holdback = max((len(s) for s in params.stop), default=1) - 1
    tokens: list[int] = []
    logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
    kept: list[torch.Tensor] = []
    text, emitted = "", 0
    finish = "length"

    start = time.perf_counter()
    logits = decoder.prefill(prompt_ids)
    reused = decoder.counters.reused_tokens
    first_token_at = start
    while True:
        if keep_logits:
            kept.append(logits.detach().clone())
        token = sample(logits, params, generator)
        if not tokens:
            first_token_at = time.perf_counter()
        tokens.append(token)
        if logprobs is not None:
            logprobs.append(top_logprobs(logits, params.logprobs))
        if detok is not None:
            text += detok.add(token)
        cut = find_stop(text, params.stop) if params.stop else -1
        if cut >= 0:
            text, finish = text[:cut], "stop"
            break
        if token in stop_ids:
            finish = "stop"
            break
        if len(tokens) >= params.max_tokens:
            break
        if max_len is not None and len(prompt_ids) + len(tokens) >= max_len:
            break
        if on_text is not None and len(text) - holdback > emitted:
            on_text(text[emitted : len(text) - holdback])
            emitted = len(text) - holdback
        logits = decoder.decode(token)
    if detok is not None and finish == "length":
        text += detok.flush()
    if on_text is not None and len(text) > emitted:
        on_text(text[emitted:])
    end = time.perf_counter()
    return GenerationResult(
        prompt_tokens=len(prompt_ids),
        token_ids=tokens,
        text=text,
        finish_reason=finish,
        reused_tokens=reused,
        kv_projections=decoder.counters.kv_projections,
        ttft_s=first_token_at - start,
        decode_s=end - first_token_at,
        logprobs=logprobs,
        step_logits=kept,
    )
