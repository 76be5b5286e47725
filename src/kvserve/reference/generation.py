"""The single-sequence generation loop over a reference decoder: sample, stream, stop.

Used by ``kvserve verify`` and the tests. Stops on an EOS id (unless ignore_eos), a stop token
id, a stop string (the text is cut before it), ``max_tokens``, or a full cache.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvserve.engine.output import append_token, take_text_delta
from kvserve.engine.request import Request
from kvserve.reference.decoders import DecodeCounters
from kvserve.sampling import SamplingParams, make_generator, sample_step
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
    # the same Request record and stop rules as the engine (engine/output.py), so the
    # reference and the engine cannot disagree on when or how a request finishes
    req = Request(
        request_id="reference",
        prompt_token_ids=list(prompt_ids),
        sampling_params=params,
        eos_token_ids=tuple(eos_token_ids),
        generator=make_generator(params.seed),
        detokenizer=IncrementalDetokenizer(tokenizer) if tokenizer is not None else None,
    )
    limit = max_len if max_len is not None else sys.maxsize
    kept: list[torch.Tensor] = []

    start = time.perf_counter()
    logits = decoder.prefill(prompt_ids)
    reused = decoder.counters.reused_tokens
    first_token_at: float | None = None
    while True:
        if keep_logits:
            kept.append(logits.detach().clone())
        # the engine's sampler with a batch of one: the same tokens and logprobs
        sampled = sample_step([logits], [params], [req.generator], [req])
        token = sampled.token_ids[0]
        if first_token_at is None:
            first_token_at = time.perf_counter()
        status = append_token(req, token, sampled.logprobs[0], limit)
        if status is not None:
            req.status = status
        if on_text is not None:
            delta = take_text_delta(req)  # holds back a possible stop string
            if delta:
                on_text(delta)
        if status is not None:
            break
        logits = decoder.decode(token)
    end = time.perf_counter()
    return GenerationResult(
        prompt_tokens=len(prompt_ids),
        token_ids=req.output_token_ids,
        text=req.text,
        finish_reason=req.status.value,
        reused_tokens=reused,
        kv_projections=decoder.counters.kv_projections,
        ttft_s=first_token_at - start,
        decode_s=end - first_token_at,
        logprobs=req.logprobs,
        step_logits=kept,
    )
