"""LLM: the offline API. ``LLM(model=...).generate(prompts, SamplingParams)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from tqdm.auto import tqdm

from kvserve.config import CacheConfig, SchedulerConfig, parse_memory
from kvserve.engine.engine import LLMEngine
from kvserve.engine.request import RequestOutput
from kvserve.models.model_session import ModelSession
from kvserve.sampling import RequestOutputKind, SamplingParams

Prompt = str | Sequence[int]
_CACHE, _SCHED = CacheConfig(), SchedulerConfig()  # immutable: the defaults' single source


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    ``kv_cache_memory``: bytes, or a string with a unit such as "2GiB" (``parse_memory``);
    ``num_kv_blocks`` sets the block count directly instead. ``kv_cache_dtype`` (and ``k_cache_dtype`` /
    ``v_cache_dtype`` for one side): "auto" keeps the exact cache; "int8", "int4", "int4_sym",
    "fp8_e4m3" hold more tokens in the same memory at a measured loss (``kvserve eval-cache``).
    """

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        device: str | None = None,
        quantization: str | None = None,
        kv_cache_memory: int | float | str | None = None,
        num_kv_blocks: int | None = None,
        block_size: int = _CACHE.block_size,
        enable_prefix_caching: bool = _CACHE.enable_prefix_caching,
        kv_cache_dtype: str = _CACHE.kv_cache_dtype,
        k_cache_dtype: str | None = None,
        v_cache_dtype: str | None = None,
        streaming_window: int | None = None,
        streaming_sinks: int = _CACHE.streaming_sinks,
        max_num_seqs: int = _SCHED.max_num_seqs,
        max_num_batched_tokens: int = _SCHED.max_num_batched_tokens,
        max_model_len: int | None = None,
        scheduling_policy: str = _SCHED.scheduling_policy,
        max_prefill_tokens_with_decodes: int | None = _SCHED.max_prefill_tokens_with_decodes,
        session: ModelSession | None = None,
        show_progress: bool = False,
        enforce_eager: bool = False,
        compile_mode: str = "sync",
        batch_invariant: bool = False,
    ) -> None:
        self.session = session or ModelSession.open(
            model, dtype, device, show_progress, quantization
        )
        cache = CacheConfig(
            block_size=block_size,
            kv_cache_memory=None if kv_cache_memory is None else parse_memory(kv_cache_memory),
            num_blocks=num_kv_blocks,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_dtype=kv_cache_dtype,
            k_cache_dtype=k_cache_dtype,
            v_cache_dtype=v_cache_dtype,
            streaming_window=streaming_window,
            streaming_sinks=streaming_sinks,
        )
        sched = SchedulerConfig(
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            scheduling_policy,
            max_prefill_tokens_with_decodes,
        )
        self.engine = LLMEngine.from_session(
            self.session,
            cache,
            sched,
            enforce_eager,
            compile_mode=compile_mode,
            batch_invariant=batch_invariant,
        )

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
        priority: Sequence[int] | None = None,
        explain_cache: bool = False,
    ) -> list[RequestOutput]:
        """Run all prompts to completion; outputs in the order of the prompts, and for a
        prompt with ``n > 1`` its n samples in a row (``index`` 0 .. n-1). Each is a final
        output (every request runs as FINAL_ONLY, whatever its ``output_kind``).

        Every prompt is checked before any is queued: one that can never fit raises
        ValueError and nothing runs. ``priority`` (one per prompt, lower first) orders them
        under ``scheduling_policy="priority"``, as in vLLM; the other policies ignore it.
        ``explain_cache``: each output's ``kv_cache`` says how much of its prompt the prefix
        cache served and why not more (``kvserve.kv.cache_explain``).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt: text, or one list of token ids
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        # only final outputs are returned: the engine builds no other
        params = [_with_kind(p, RequestOutputKind.FINAL_ONLY) for p in params]
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        engine = self.engine
        encoded = [engine.encode(p) for p in prompts]
        for ids, p in zip(encoded, params, strict=True):
            engine.limits.check(ids, p)
        order = []
        for ids, p, prio in zip(encoded, params, priorities, strict=True):
            rid = engine.add_request(
                ids, p, cache_salt=cache_salt, priority=prio, explain_cache=explain_cache
            ).request_id
            order += [rid] + [f"{rid}-{i}" for i in range(1, p.n)]  # ids the engine forks
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(order), desc="requests", disable=not use_tqdm) as bar:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        return [final[rid] for rid in order]

    def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        cache_salt: str | None = None,
        explain_cache: bool = False,
    ) -> Iterator[RequestOutput]:
        """One request, yielding an output per generated token (the last one has finished=True).

        The request runs as DELTA: each output has its step's ``new_token_ids``, ``new_text``
        and ``new_logprobs``; only the last also has the whole ``token_ids``, ``text`` and
        ``logprobs``. Stopping the iteration early aborts the request and frees its blocks.
        """
        engine = self.engine
        if sampling_params is not None and sampling_params.n > 1:
            raise ValueError(
                f"stream() follows one sample; got n={sampling_params.n} (use generate)"
            )
        params = _with_kind(sampling_params or SamplingParams(), RequestOutputKind.DELTA)
        req = engine.add_request(prompt, params, cache_salt=cache_salt, explain_cache=explain_cache)
        try:
            while True:
                for out in engine.step():
                    if out.request_id == req.request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            if not req.status.finished:
                engine.abort_request(req.request_id)


def _with_kind(params: SamplingParams, kind: RequestOutputKind) -> SamplingParams:
    return params if params.output_kind is kind else dataclasses.replace(params, output_kind=kind)
