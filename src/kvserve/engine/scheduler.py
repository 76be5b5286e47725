"""Continuous batching: which requests run this step, and how many tokens each.

Every step mixes decodes (one token) and prefill chunks under two limits:
``max_num_batched_tokens`` per step and ``max_num_seqs`` running requests. Decodes go first
(Sarathi-Serve), in admission order; a step that carries decodes then takes at most
``max_prefill_tokens_with_decodes`` prefill tokens, so that its length (every stream's
inter-token latency) stays bounded while prompts are prefilled. The prefill part is running
prefills (chunked) and waiting requests from their prefix-cache hit: under "fcfs" and "lpm"
running prefills continue before anything is admitted; under "priority" the two compete by
(priority, arrival), so a high-priority arrival is admitted before a low-priority prefill
continues. When the pool is out of blocks for a running request, the newest running request
(under "priority": the worst-ranked, batch members first) is preempted: its blocks are freed
and it goes back to the front of the waiting queue, to be recomputed later (usually through
its own prefix-cache hit). A step that preempted for a running request admits no new request.

Under "priority" the scheduler is also fair (engine/fairness.py): the waiting queue puts
interactive requests before batch members and tenants round-robin, and a waiting request with
no seat or no KV preempts a running one it outranks (an interactive one a batch member; one
of a tenant running two or more sequences fewer, a request of that tenant), so a batch that
fills every seat holds a chat out for one step at most.

The scheduler knows requests and block ids, never tensors: ``SchedulerOutput`` is plain data
for the model runner.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvserve.config import SchedulerConfig
from kvserve.engine import fairness
from kvserve.engine.request import Request, RequestStatus
from kvserve.kv.manager import KVCacheManager


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    num_computed_tokens: int  # tokens already in the cache before this step
    num_new_tokens: int  # tokens this step computes
    block_tables: tuple[list[int], ...]  # per cache group, after allocation (-1: given back)
    samples: bool  # this step reaches the request's last token: sample from its logits

    @property
    def block_ids(self) -> list[int]:
        """The first group's block table (a full-attention model's only one)."""
        return self.block_tables[0]


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(
        default_factory=list
    )  # copy-on-write, before the step
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(slots=True)
class _StepBudget:
    budget: int  # tokens this step may still schedule
    new_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens this step
    loads: fairness.TenantLoads = field(default_factory=dict)  # sequences running per tenant
    # preempted this step to seat a waiting request that outranks them ("priority"); they
    # rejoin the queue at the end of the step, behind those preempted for a running request
    bumped: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv_manager: KVCacheManager, max_model_len: int
    ) -> None:
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # n > 1: parent request id -> its unfinished forked samples (outlives the parent, so
        # aborting the parent's id finds them); kept so abort never scans every request
        self.children: dict[str, list[Request]] = {}
        self.num_preemptions = 0

    # -- admission -------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        # that it fits was checked at the engine's boundary (RequestLimits.check)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def add_fork(self, parent: Request, child: Request) -> None:
        """A sibling sample of a running parent: shares its blocks, runs from the next step."""
        assert parent.status == RequestStatus.RUNNING and child.request_id not in self.requests
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.first_scheduled_time = parent.first_scheduled_time
        child.block_hashes = list(parent.block_hashes)
        child.status = RequestStatus.RUNNING
        self.kv.fork(parent, child)
        self.requests[child.request_id] = child
        self.children.setdefault(parent.request_id, []).append(child)
        self.running.append(child)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark finished and release everything it holds (any state)."""
        assert status.finished
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        self._release(req, status)

    def finish_many(self, reqs: list[Request], status: RequestStatus) -> None:
        """``finish`` for many at once: one pass over each queue, not one per request."""
        assert status.finished
        running: set[str] = set()
        waiting: set[str] = set()
        live = []
        for r in reqs:  # identity compares: Enum hashing is Python code, slow at 16k
            if r.status is RequestStatus.RUNNING:
                running.add(r.request_id)
            elif r.status is RequestStatus.WAITING or r.status is RequestStatus.PREEMPTED:
                waiting.add(r.request_id)
            else:
                continue  # finished already
            live.append(r)
        if running:
            self.running = [r for r in self.running if r.request_id not in running]
        if waiting:
            self.waiting = deque(r for r in self.waiting if r.request_id not in waiting)
        now = time.monotonic()
        for r in live:
            self._release(r, status, now)

    def _release(self, req: Request, status: RequestStatus, now: float | None = None) -> None:
        req.status = status
        req.finished_time = time.monotonic() if now is None else now
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        if req.parent_id is not None:
            siblings = self.children.get(req.parent_id)
            if siblings is not None:
                siblings.remove(req)  # at most n - 1 long
                if not siblings:
                    del self.children[req.parent_id]

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        step = _StepBudget(self.config.max_num_batched_tokens)
        by_priority = self.config.scheduling_policy == "priority"
        if by_priority:  # before any preemption: this step's preempted stay first in line
            step.loads = fairness.tenant_loads(self.running)
            self.waiting = deque(fairness.order_fairly(self.waiting, step.loads))
        # decodes first (Sarathi-Serve): a prefill chunk admitted earlier must not take the
        # step's budget from requests that need only their next token
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        partial = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes:
            if step.budget <= 0:
                break
            if req.status is RequestStatus.RUNNING:  # not preempted by an earlier one
                self._schedule_running(req, step, out)
        cap = self.config.max_prefill_tokens_with_decodes
        if step.new_tokens and cap is not None:
            # a step that carries decodes takes a bounded prefill: the step's length is every
            # streaming client's inter-token latency, and the next arrival's wait
            step.budget = min(step.budget, cap)

        if by_priority:
            partial.sort(key=fairness.rank)
        elif self.config.scheduling_policy == "lpm" and self.kv.enable_prefix_caching:
            self._order_longest_prefix_first()
        pending = self._pending_prefix_hashes()
        deferred: list[Request] = []
        admitting = True
        now = time.monotonic()
        i = 0
        while step.budget > 0:
            if i < len(partial) and partial[i].status is not RequestStatus.RUNNING:
                i += 1  # preempted this step
                continue
            head = partial[i] if i < len(partial) else None
            admitting = (
                admitting
                # a step that preempted for a running request admits no new request
                and len(out.preempted) == len(step.bumped)
                and bool(self.waiting)
                # priority: a full house may still seat a request that outranks a member
                and (by_priority or len(self.running) < self.config.max_num_seqs)
            )
            # fcfs / lpm: running prefills continue before anything is admitted; priority:
            # a waiting request that outranks the next running prefill goes first
            if admitting and (
                head is None
                or (by_priority and fairness.rank(self.waiting[0]) < fairness.rank(head))
            ):
                req = self.waiting.popleft()
                admitting = self._admit(req, step, pending, deferred, now, out, by_priority)
            elif head is not None:
                self._schedule_running(head, step, out)
                i += 1
            else:
                break
        # the bumped (all preempted before any preemption for a running request: none is
        # admitted after one) behind those, most recent first, as _preempt would have put them
        grown = len(out.preempted) - len(step.bumped)
        for req in step.bumped:
            self.waiting.insert(grown, req)
        # deferred admissions back near the front, in order, but behind this step's preempted
        # requests (_preempt put them first in the queue, and nothing is admitted after a
        # preemption): those were running and go back first (found by hypothesis: a deferral
        # and a preemption in one step)
        for req in reversed(deferred):
            self.waiting.insert(len(out.preempted), req)

        for req in self.running:
            n = step.new_tokens.get(req.request_id)
            if n:
                out.scheduled.append(
                    ScheduledRequest(
                        req.request_id,
                        req.num_computed_tokens,
                        n,
                        self.kv.block_tables(req.request_id),
                        samples=req.num_computed_tokens + n == req.num_tokens,
                    )
                )
        return out

    def _schedule_running(self, req: Request, step: _StepBudget, out: SchedulerOutput) -> None:
        """Give a running request its next chunk, preempting the newest running requests
        (``req`` itself last) until its blocks fit."""
        n = min(req.num_tokens - req.num_computed_tokens, step.budget)
        if n <= 0:
            return
        by_priority = self.config.scheduling_policy == "priority"
        while not self._try_allocate(req, n, out):
            victim = fairness.victim(self.running, step.loads) if by_priority else None
            victim = victim or self.running[-1]
            self._preempt(victim, out, step)
            if victim is req:
                return
        step.new_tokens[req.request_id] = n
        step.budget -= n

    def _admit(
        self,
        req: Request,
        step: _StepBudget,
        pending: set[bytes],
        deferred: list[Request],
        now: float,
        out: SchedulerOutput,
        by_priority: bool,
    ) -> bool:
        """Admit the waiting ``req`` (popped by the caller) from its prefix-cache hit; under
        "priority", preempting running requests it outranks while it has no seat or no KV.
        Returns False when there is no room for it: it goes back first in line and nothing
        more is admitted this step."""
        while True:
            computed, num_hit = self.kv.get_computed_blocks(req)
            if self._next_block_pending(req, num_hit, pending):
                deferred.append(req)  # its prefix is being computed: wait and hit it
                return True
            n = min(req.num_tokens - num_hit, step.budget)
            # before allocating: new blocks may evict the very cached block a miss is
            # explained by; a preempted request's explanation stays its first
            first = req.num_cached_tokens < 0
            why = self.kv.explain(req, num_hit) if req.explain_cache and first else None
            if len(self.running) < self.config.max_num_seqs:
                if self.kv.allocate_slots(req, n, computed) is not None:
                    break
            victim = self._outranked_by(req, step.loads) if by_priority else None
            if victim is None:
                self.waiting.appendleft(req)  # no room now; it stays first in line
                return False
            self._preempt(victim, out, step, bumped=True)
        self.kv.record_prefix_lookup(req.num_tokens, num_hit)
        pending.update(self._uncomputed_prompt_hashes(req, num_hit))
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
            req.cache_explanation = why
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        step.loads[req.tenant] = step.loads.get(req.tenant, 0) + fairness.sequences(req)
        step.new_tokens[req.request_id] = n
        step.budget -= n
        return True

    def _outranked_by(self, req: Request, loads: fairness.TenantLoads) -> Request | None:
        """The running request the waiting ``req`` may preempt for its seat and KV, if any."""
        return fairness.victim(self.running, loads, lambda r: fairness.outranks(req, r, loads))

    # -- in-batch prefix sharing -------------------------------------------------------------
    # Requests admitted together cannot hit each other's blocks: blocks enter the prefix cache
    # only once computed. A waiting request whose next uncached block is being computed right
    # now by a running request (a shared system prompt) is deferred a step or a few, then hits
    # instead of computing the same prefix again (SGLang's in-batch prefix check).
    def _uncomputed_prompt_hashes(self, req: Request, num_computed: int) -> list[bytes]:
        full = req.num_prompt_tokens // self.kv.block_size
        return req.block_hashes[num_computed // self.kv.block_size : full]

    def _pending_prefix_hashes(self) -> set[bytes]:
        if not self.kv.enable_prefix_caching:
            return set()
        pending: set[bytes] = set()
        for req in self.running:
            if req.num_computed_tokens < req.num_prompt_tokens:
                pending.update(self._uncomputed_prompt_hashes(req, req.num_computed_tokens))
        return pending

    def _next_block_pending(self, req: Request, num_hit: int, pending: set[bytes]) -> bool:
        idx = num_hit // self.kv.block_size
        return bool(pending) and idx < len(req.block_hashes) and req.block_hashes[idx] in pending

    def _order_longest_prefix_first(self) -> None:
        preempted = [r for r in self.waiting if r.status == RequestStatus.PREEMPTED]
        fresh = [r for r in self.waiting if r.status != RequestStatus.PREEMPTED]
        hits = {r.request_id: self.kv.get_computed_blocks(r)[1] for r in fresh}
        fresh.sort(key=lambda r: -hits[r.request_id])  # stable: ties keep arrival order
        self.waiting = deque(preempted + fresh)

    def _try_allocate(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        cow = self.kv.cow_blocks_needed(req)
        if cow and self.kv.pool.num_free_blocks < cow + self.kv.num_blocks_needed(req, n):
            return False
        if cow:
            out.block_copies.extend(self.kv.prepare_write(req))
        return self.kv.allocate_slots(req, n) is not None

    def _preempt(
        self, req: Request, out: SchedulerOutput, step: _StepBudget, bumped: bool = False
    ) -> None:
        """Free ``req``'s blocks and send it back to wait (recompute). ``bumped``: preempted
        for a waiting request that outranks it; it rejoins the queue at the end of the step
        (so it is not admitted again in this one)."""
        self.running.remove(req)
        self.kv.free(req)
        step.budget += step.new_tokens.pop(req.request_id, 0)
        step.loads[req.tenant] = step.loads.get(req.tenant, 0) - fairness.sequences(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        if bumped:
            step.bumped.append(req)
        else:
            self.waiting.appendleft(req)
        out.preempted.append(req.request_id)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """The step ran: advance computed counts and register newly full blocks."""
        for s in out.scheduled:
            req = self.requests[s.request_id]
            req.num_computed_tokens += s.num_new_tokens
            req.kv_projections += s.num_new_tokens
            self.kv.cache_blocks(req, req.num_computed_tokens)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
