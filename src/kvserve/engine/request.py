"""Request: one prompt's journey through the engine, and RequestOutput, what callers see."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvserve.kv.cache_explain import CacheExplanation
from kvserve.sampling import SamplingParams
from kvserve.tokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks taken back; waiting to be recomputed
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"
    # a step it was in raised (engine/faults.py): the request is dropped, ``error`` says why
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


class RequestClass(enum.IntEnum):
    """What kind of work a request is, for the "priority" policy's fairness
    (engine/fairness.py); lower runs first. The server marks a request group of one prompt
    with n = 1 (a chat turn) interactive, every prompt of a multi-prompt completion and every
    n > 1 request batch; the engine's own default is interactive."""

    INTERACTIVE = 0  # waits for a seat at most a step: batch members are preempted for it
    BATCH = 1  # yields its seats (and KV) to interactive requests, and to tenants below share


@dataclass(slots=True, eq=False)
class Request:
    """Mutable state of one request. ``all_token_ids`` = prompt + output; the first
    ``num_computed_tokens`` of them have K/V in the cache."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # the "priority" policy: lower runs first, ties by arrival (vLLM)
    # the "priority" policy's fairness (engine/fairness.py): interactive before batch, and
    # among tenants (API keys; None: no tenants) the one running fewer sequences first
    request_class: RequestClass = RequestClass.INTERACTIVE
    tenant: str | None = None
    explain_cache: bool = False  # say at admission why the prefix cache served what it did
    cache_explanation: CacheExplanation | None = None  # set at first admission, if asked
    all_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = (
        -1
    )  # prompt tokens served by the prefix cache (set when first scheduled)
    block_hashes: list[bytes] = field(default_factory=list)
    num_preemptions: int = 0
    kv_projections: int = 0  # tokens whose K/V this request computed (recomputation included)
    # StreamingLLM policy (CacheConfig.streaming_window): sinks + window, the tokens its cache
    # keeps for attention; None: nothing is ever dropped
    streaming_keep: int | None = None
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""
    num_emitted_chars: int = 0  # text already handed out in outputs
    num_emitted_tokens: int = 0  # output tokens (and their logprobs) already handed out
    logprobs: list[dict[int, float]] | None = None
    # prompt_logprobs requested: per prompt token, its position's top-k + the token itself
    # (entry 0 None: nothing predicts the first token); the prefill chunks fill it in order
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ranks: list[int | None] | None = None  # each prompt token's rank (1 = best)
    parent_id: str | None = None  # n > 1: the request this sample was forked from
    sample_index: int = 0  # n > 1: which of the n samples this is
    forked: bool = False  # n > 1: the parent has made its n - 1 siblings
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    error: str | None = None  # FINISHED_ERROR: the failure that ended it

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.sampling_params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs, self.prompt_token_ranks = [None], [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """A prefix-cache hit would skip positions whose prompt logprobs are still missing
        (vLLM skips the hit too); once they are all in, a recompute may hit again."""
        pl = self.prompt_logprobs
        return pl is not None and len(pl) < self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def sample(
        self,
        index: int,
        generator: torch.Generator | None,
        detokenizer: IncrementalDetokenizer | None,
    ) -> Request:
        """Sample ``index`` of this n > 1 request after its first token: the same prompt,
        tokens so far, class and cache facts; its own generator and detokenizer."""
        return Request(
            request_id=f"{self.request_id}-{index}",
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling_params,
            eos_token_ids=self.eos_token_ids,
            cache_salt=self.cache_salt,
            arrival_time=self.arrival_time,
            priority=self.priority,
            request_class=self.request_class,
            tenant=self.tenant,
            streaming_keep=self.streaming_keep,
            all_token_ids=list(self.all_token_ids),
            generator=generator,
            detokenizer=detokenizer,
            prompt_logprobs=self.prompt_logprobs,  # complete, never changed again
            prompt_token_ranks=self.prompt_token_ranks,
            cache_explanation=self.cache_explanation,  # the prompt's, shared
            parent_id=self.request_id,
            sample_index=index,
            forked=True,
        )


@dataclass(slots=True)
class RequestOutput:
    """A request after a step: what its earlier outputs did not carry, and, on the final
    output (or every output with ``output_kind=CUMULATIVE``), everything so far.

    ``new_*`` is this step's delta (one token; for FINAL_ONLY, the whole output). The whole
    lists ``token_ids``, ``text`` and ``logprobs`` are None on a non-final output of a DELTA
    request: building them each step would make a stream of T tokens cost O(T^2).
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str  # stream-safe: text that might begin a stop string is held back
    new_logprobs: list[dict[int, float]] | None  # one per new token; None: not requested
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    token_ids: list[int] | None  # all output tokens so far; None: a non-final DELTA output
    text: str | None  # all output text so far; None: a non-final DELTA output
    logprobs: list[dict[int, float]] | None  # per output token; None: not requested, or as text
    num_cached_tokens: int
    queue_time_s: float | None  # arrival -> first scheduled
    ttft_s: float | None  # arrival -> first token
    decode_time_s: float | None  # first token -> finished
    num_preemptions: int = 0
    kv_projections: int = 0
    parent_request_id: str | None = None  # n > 1: the id the caller gave (samples share it)
    index: int = 0  # n > 1: which sample of that request
    error: str | None = None  # finish_reason "error": the failure, e.g. "RuntimeError: ..."
    # prompt_logprobs requested: one entry per prompt token (the first None), complete on
    # every output (they are known before the first token is sampled)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ranks: list[int | None] | None = None  # rank of each prompt token (1 = best)
    # explain_cache requested: how much of the prompt the prefix cache served, and why not more
    kv_cache: CacheExplanation | None = None
    # the StreamingLLM policy: tokens of the sequence no longer attended (between the sinks and
    # the window; finish_reason is unchanged by it); None when the policy is off
    num_dropped_tokens: int | None = None
