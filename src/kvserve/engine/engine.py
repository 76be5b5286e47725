"""LLMEngine: add_request / step / abort_request / has_unfinished_requests.

``step()`` = schedule -> run the model -> sample the whole batch at once -> update requests,
free what finished. A step that raises fails only its own requests (engine/faults.py).
One engine owns one model, one paged KV cache and one scheduler; nothing is global, so a
process may hold several.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvserve.config import (
    DEFAULT_KV_CACHE_MEMORY,
    STREAMING_MAX_LEN,
    CacheConfig,
    SchedulerConfig,
)
from kvserve.engine.compiled_steps import CompileResult
from kvserve.engine.faults import FaultInjector, StepRecord, contain_step_failure, fail_all
from kvserve.engine.fused_decode import FusedDecode
from kvserve.engine.limits import RequestLimits
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.output import append_token, make_output
from kvserve.engine.prompt_logprobs import add_prompt_logprobs
from kvserve.engine.request import Request, RequestClass, RequestOutput, RequestStatus
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.step_compiler import StepCompiler
from kvserve.kv import persist
from kvserve.kv.cache_dtype import CacheDtype
from kvserve.kv.events import KVCacheEvent
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.persist import CacheSnapshot, PersistReport
from kvserve.kv.storage import KVCacheStorage
from kvserve.models.config import ModelConfig
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.model_session import ModelSession
from kvserve.sampling import SamplingParams, make_generator, sample_step
from kvserve.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks: int
    num_used_blocks: int
    kv_cache_usage: float  # used blocks / total
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_preemptions: int
    prompt_tokens: int  # tokens of prompts admitted
    generation_tokens: int  # tokens generated
    scheduler_time_s: float  # wall time spent in KV bookkeeping and scheduling
    model_time_s: float  # wall time spent running the model


class LLMEngine:
    def __init__(
        self,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        tokenizer: Tokenizer | None,
        cache_config: CacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        eos_token_ids: Sequence[int] = (),
        enforce_eager: bool = False,
        faults: FaultInjector | None = None,
        compile_mode: str = "sync",
        batch_invariant: bool = False,
    ) -> None:
        cache_config = cache_config or CacheConfig()
        scheduler_config = scheduler_config or SchedulerConfig()
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        streaming = cache_config.streaming
        # StreamingLLM: a request may run past the model's context (its cache stays flat)
        limit = STREAMING_MAX_LEN if streaming else model_config.max_model_len
        wanted = scheduler_config.max_model_len
        if wanted is not None and wanted > limit:
            raise ValueError(
                f"max_model_len {wanted} exceeds the model's context of {limit} tokens"
            )
        self.max_model_len = wanted or limit
        self.streaming_keep = None if streaming is None else sum(streaming)  # sinks + window
        k_name, v_name = cache_config.cache_dtypes
        self.spec = model.kv_cache_spec(
            CacheDtype.parse(k_name, model.dtype),
            CacheDtype.parse(v_name, model.dtype),
            cache_config.block_size,
            streaming,
        )
        num_blocks = cache_config.num_blocks or self.spec.num_blocks_for(
            cache_config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
        )
        self.storage = KVCacheStorage(self.spec, num_blocks, model.device, model.dtype)
        self.kv_manager = KVCacheManager(
            num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            cache_config.enable_kv_cache_events,
            [g.spec for g in self.spec.groups],
        )
        self.scheduler = Scheduler(scheduler_config, self.kv_manager, self.max_model_len)
        self.limits = RequestLimits(
            vocab_size=model_config.vocab_size,
            max_model_len=self.max_model_len,
            num_blocks=num_blocks,
            block_size=cache_config.block_size,
            has_tokenizer=tokenizer is not None,
            pool_tokens=self._pool_tokens(num_blocks),
        )
        self.fused_decode = FusedDecode.build(model, self.storage, batch_invariant)
        # "background": eager now, the compiled step between requests once it is ready. When
        # every step runs fused, no layer step is ever called: nothing to compile
        every_step = self.fused_decode is not None and self.fused_decode.every_step
        self.compiler = StepCompiler(model, enforce_eager or every_step, compile_mode)
        self.compile_result = self.compiler.result
        self.runner = ModelRunner(
            model, self.storage, self.compile_result.steps, self.fused_decode, faults
        )
        self._ids = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.scheduler_time_s = 0.0
        self.model_time_s = 0.0
        self.num_failed_steps = 0  # steps that raised (their requests failed)
        self.consecutive_step_failures = 0  # since the last step that did not raise
        mha = self.spec.mha_equivalent_bytes_per_token  # MLA: the cache it replaces
        logger.info(
            "KV cache: %d blocks x %d tokens, %.1f MiB (%d bytes/token; %s)%s",
            num_blocks,
            self.spec.block_size,
            self.storage.nbytes / 2**20,
            self.spec.bytes_per_token,
            self.spec.describe(),
            "" if mha == self.spec.bytes_per_token else f"; as MHA {mha:,} bytes/token",
        )

    def _pool_tokens(self, num_blocks: int) -> int:
        """The longest request the pool can hold: every group windowed, any length (its
        blocks stop growing) as long as its steady state fits."""
        longest = self.spec.max_tokens_for(num_blocks)
        if longest is not None:
            return longest
        steady = self.spec.max_blocks(self.max_model_len)
        return self.max_model_len if steady <= num_blocks else num_blocks * self.spec.block_size

    @classmethod
    def from_session(
        cls,
        session: ModelSession,
        cache: CacheConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        enforce_eager: bool = False,
        faults: FaultInjector | None = None,
        compile_mode: str = "sync",
        batch_invariant: bool = False,
    ) -> LLMEngine:
        return cls(
            session.model,
            session.config,
            session.tokenizer,
            cache,
            scheduler,
            session.eos_token_ids,
            enforce_eager,
            faults,
            compile_mode,
            batch_invariant,
        )

    # -- requests ---------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        self.limits.check_token_ids(ids)
        return ids

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        explain_cache: bool = False,
        request_class: RequestClass = RequestClass.INTERACTIVE,
        tenant: str | None = None,
    ) -> Request:
        """Queue a request; raises ValueError (``RequestRejected``, naming the field) if it can
        never run (nothing is queued then). ``priority`` orders admission under the
        "priority" scheduling policy (lower first) and is ignored by the others, as are
        ``request_class`` and ``tenant``, that policy's fairness (engine/fairness.py): an
        interactive request preempts batch members for a seat, and a tenant running fewer
        sequences is admitted first (preempting a tenant that runs at least two more).
        ``explain_cache``: the outputs carry ``kv_cache``, how much of the prompt the prefix
        cache served and why not more (kv/cache_explain.py)."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        self.limits.check(ids, params)
        req = Request(
            request_id=request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            cache_salt=cache_salt,
            priority=priority,
            request_class=request_class,
            tenant=tenant,
            explain_cache=explain_cache,
            streaming_keep=self.streaming_keep,
            generator=make_generator(params.seed, self.runner.device),
            detokenizer=IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None,
        )
        self.scheduler.add_request(req)
        self.prompt_tokens_total += len(ids)
        return req

    def _fork(self, parent: Request) -> list[Request]:
        params = parent.sampling_params
        children = []
        for i in range(1, params.n):
            # sample i draws from seed + i: reproducible, the same as a lone request with it
            seed = None if params.seed is None else params.seed + i
            detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None
            child = parent.sample(i, make_generator(seed, self.runner.device), detok)
            self.scheduler.add_fork(parent, child)
            children.append(child)
        return children

    def abort_request(self, request_id: str) -> bool:
        """Abort in any state; frees every block it held. False if unknown or finished."""
        return self.abort_requests([request_id]) > 0

    def abort_requests(self, request_ids: Sequence[str]) -> int:
        """Abort these requests in any state, and every sample forked from them (also once
        sample 0 has finished); returns how many were aborted. O(ids + their samples +
        waiting), whatever else the engine holds: a 16k-prompt batch aborts in one pass."""
        requests, children = self.scheduler.requests, self.scheduler.children
        targets: dict[str, Request] = {}  # by id: a sample named twice is aborted once
        for rid in request_ids:
            req = requests.get(rid)
            if req is not None:
                targets[rid] = req
            for child in children.get(rid, ()):
                targets[child.request_id] = child
        self.scheduler.finish_many(list(targets.values()), RequestStatus.FINISHED_ABORTED)
        return len(targets)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step; its outputs. An exception inside it (not KeyboardInterrupt / SystemExit)
        fails only the requests that were in it (finish_reason "error", ``error`` set), after
        which the KV state is repaired and checked (engine/faults.py); the rest go on."""
        if self.compiler.background is not None:
            self._adopt_compiled()
        record = StepRecord()
        try:
            outputs = self._step(record)
        except Exception as e:  # noqa: BLE001 - contained: see engine/faults.py
            self.num_failed_steps += 1
            self.consecutive_step_failures += 1
            return contain_step_failure(self, record, e)
        self.consecutive_step_failures = 0
        return outputs

    def _adopt_compiled(self) -> None:
        """Run the background compile's steps once ready, between requests only."""
        result = self.compiler.take(requests_running=bool(self.scheduler.running))
        if result is not None:
            self.compile_result = result
            self.runner.steps = result.steps

    def close(self) -> None:
        """Stop a background compile (waits for its current token count). Call before the
        process exits; the engine still steps afterwards, on the steps it has."""
        self.compiler.close()

    def wait_compiled(self, timeout_s: float | None = None) -> CompileResult:
        """Block until a background compile is done, and run it if no request is running."""
        self.compiler.wait(timeout_s)
        self._adopt_compiled()
        return self.compile_result

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Fail every request (finish_reason "error") and rebuild the KV bookkeeping and the
        prefix cache from scratch: for a caller that gave up on the current state."""
        self.consecutive_step_failures = 0
        return fail_all(self, message)

    def _step(self, record: StepRecord) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        requests = self.scheduler.requests
        record.requests.extend(requests[s.request_id] for s in sched.scheduled)
        t1 = time.perf_counter()
        ran = self.runner.execute(sched, requests)
        logits = ran.logits
        t2 = time.perf_counter()
        for request_id, chunk in ran.prompt_logprobs.items():
            add_prompt_logprobs(requests[request_id], chunk)
        self.scheduler.update_after_step(sched)
        self.scheduler_time_s += (t1 - t0) + (time.perf_counter() - t2)
        self.model_time_s += t2 - t1
        now = time.monotonic()
        for request_id, row in list(logits.items()):
            req = requests[request_id]
            if req.sampling_params.n > 1 and not req.forked:
                # the prompt is in the cache: its n - 1 siblings share it and sample from
                # the same logits, each with its own generator
                req.forked = True
                record.forked.append(request_id)
                for child in self._fork(req):
                    logits[child.request_id] = row
                    record.requests.append(child)
        if not logits:
            return []
        reqs = [requests[rid] for rid in logits]
        # every request of the step in one sampler call (and one for the logprobs)
        sampled = sample_step(
            list(logits.values()),
            [r.sampling_params for r in reqs],
            [r.generator for r in reqs],
            reqs,  # the token histories, read only by rows with penalties
        )
        outputs = record.outputs  # what a failure later in the step still hands out
        for req, token, lp in zip(reqs, sampled.token_ids, sampled.logprobs, strict=True):
            if req.first_token_time is None:
                req.first_token_time = now
            self.generation_tokens_total += 1
            status = append_token(req, token, lp, self.max_model_len)
            if status is not None:
                self.scheduler.finish(req, status)
            out = make_output(req)
            if out is not None:  # None: a FINAL_ONLY request still running
                outputs.append(out)
        return outputs

    def stats(self) -> EngineStats:
        pool = self.kv_manager.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks=pool.num_blocks,
            num_used_blocks=pool.num_used_blocks,
            kv_cache_usage=pool.usage,
            prefix_cache_queries=self.kv_manager.prefix_queries,
            prefix_cache_hits=self.kv_manager.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens_total,
            generation_tokens=self.generation_tokens_total,
            scheduler_time_s=self.scheduler_time_s,
            model_time_s=self.model_time_s,
        )

    def check_integrity(self) -> None:
        self.kv_manager.check_integrity()

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The prefix-cache index changes since the last call (kv/events.py); empty unless
        ``CacheConfig.enable_kv_cache_events``."""
        return self.kv_manager.take_events()

    def snapshot_prefix_cache(self) -> CacheSnapshot:
        """A copy of every cached block (hashes, tokens, K/V) to write with ``kv.persist``."""
        return persist.snapshot(self.kv_manager.pool, self.storage)

    def load_prefix_cache(self, directory: Path, fingerprint: Mapping[str, str]) -> PersistReport:
        """Reload a saved prefix cache into free blocks if its fingerprint is this engine's
        (``cache_fingerprint``); a refused file loads nothing and the report says why."""
        if not self.kv_manager.enable_prefix_caching:
            return PersistReport(Path(directory), 0, 0, "prefix caching is off")
        return persist.load(self.kv_manager.pool, self.storage, directory, fingerprint)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no request holds (vLLM's reset_prefix_cache, but
        partial: blocks of running requests keep their hashes). Returns how many."""
        return self.kv_manager.pool.reset_prefix_cache()
