"""Scheduler + KVCacheManager driven without a model.

A fake "model" stands in for the runner: it applies the step's block copies, writes each
scheduled token id into a slot table (``block_id * block_size + offset``) where the real
runner would write K/V, and checks that every request reads back exactly its own tokens for
every position it attends to. That catches a prefix-cache hit handing out the wrong block,
a shared block being overwritten, or a block being reused while still referenced, on top of
the bookkeeping invariants (``check_integrity``, block counts, step limits).
"""

from __future__ import annotations

import itertools
import math

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from kvserve.config import SchedulerConfig
from kvserve.engine.output import append_token
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.prefix_cache import hash_block
from kvserve.sampling import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 12
VOCAB = 3
MAX_MODEL_LEN = 64
MAX_NUM_SEQS = 4
MAX_BATCHED = 16

# shared prefixes so that prompts collide often enough to exercise prefix-cache hits
PREFIXES = ([], [0, 1, 2, 0, 1, 2, 0, 1], [2, 2, 1, 1, 0, 0, 2, 2, 1, 1, 0, 0])


class FakeModel:
    """Where the K/V of each token would be: one token id per cache slot."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.bs = sched.kv.block_size
        self.slots: dict[int, int] = {}

    def slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.bs] * self.bs + pos % self.bs

    def execute(self, out: SchedulerOutput) -> None:
        for src, dst in out.block_copies:
            for off in range(self.bs):
                s = src * self.bs + off
                if s in self.slots:
                    self.slots[dst * self.bs + off] = self.slots[s]
                else:
                    self.slots.pop(dst * self.bs + off, None)
        # write every token of the step first (as every layer does), then read
        for s in out.scheduled:
            req = self.sched.requests[s.request_id]
            end = s.num_computed_tokens + s.num_new_tokens
            assert len(s.block_ids) * self.bs >= end, "block table too short for the step"
            for pos in range(s.num_computed_tokens, end):
                self.slots[self.slot(s.block_ids, pos)] = req.all_token_ids[pos]
        for s in out.scheduled:
            req = self.sched.requests[s.request_id]
            self.check_reads(req, s.block_ids, s.num_computed_tokens + s.num_new_tokens)

    def check_reads(self, req: Request, block_ids: list[int], n: int) -> None:
        got = [self.slots.get(self.slot(block_ids, pos)) for pos in range(n)]
        assert got == req.all_token_ids[:n], (
            f"{req.request_id} reads {got}, expected {req.all_token_ids[:n]} (blocks {block_ids})"
        )


def make_scheduler(
    num_blocks: int = NUM_BLOCKS,
    max_num_seqs: int = MAX_NUM_SEQS,
    max_batched: int = MAX_BATCHED,
    enable_prefix_caching: bool = True,
    enable_kv_cache_events: bool = False,
    **config: object,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching, enable_kv_cache_events)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched, **config)
    return Scheduler(sched, kv, MAX_MODEL_LEN)


def run_step(sched: Scheduler, model: FakeModel, tokens) -> SchedulerOutput:
    """schedule -> fake model -> update -> append sampled tokens, finish what stops."""
    out = sched.schedule()
    assert out.num_tokens <= sched.config.max_num_batched_tokens
    assert len(sched.running) <= sched.config.max_num_seqs
    assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
    # preempted requests go back to the front of the line, in their admission order
    n = len(out.preempted)
    assert [r.request_id for r in list(sched.waiting)[:n]] == out.preempted[::-1]
    for s in out.scheduled:
        assert s.num_new_tokens > 0
        assert s.request_id not in out.preempted
        req = sched.requests[s.request_id]
        assert req.status == RequestStatus.RUNNING
        assert s.samples == (s.num_computed_tokens + s.num_new_tokens == req.num_tokens)
    model.execute(out)
    sched.update_after_step(out)
    sched.kv.check_integrity()
    for s in out.scheduled:
        if s.samples:
            req = sched.requests[s.request_id]
            status = append_token(req, next(tokens), None, sched.max_model_len)
            if status is not None:
                sched.finish(req, status)
    sched.kv.check_integrity()
    return out


def assert_all_free(kv: KVCacheManager) -> None:
    kv.check_integrity()
    pool = kv.pool
    assert kv.req_to_blocks == {}
    assert kv.num_cached_blocks == {}
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    for h, block in pool.cached.items():
        assert block.block_hash == h
        assert pool.free_queue.contains(block)
        assert len(block.token_ids) == kv.block_size


def check_scheduler_state(sched: Scheduler, model: FakeModel) -> None:
    kv = sched.kv
    kv.check_integrity()
    bs = kv.block_size
    assert len(sched.running) <= sched.config.max_num_seqs
    assert len({id(r) for r in sched.running}) == len(sched.running)
    assert not set(map(id, sched.running)) & set(map(id, sched.waiting))
    assert set(sched.requests) == {r.request_id for r in [*sched.running, *sched.waiting]}
    holders = {r.request_id for r in sched.running}
    assert set(kv.req_to_blocks) <= holders, "only running requests hold blocks"
    for req in sched.running:
        assert req.status == RequestStatus.RUNNING
        blocks = kv.blocks_of(req.request_id)
        # between steps a running request holds exactly the blocks its computed tokens fill
        assert len(blocks) == math.ceil(req.num_computed_tokens / bs), (
            req.request_id,
            req.num_computed_tokens,
            [b.block_id for b in blocks],
        )
        assert 0 < req.num_computed_tokens <= req.num_tokens
        assert req.num_tokens - req.num_computed_tokens >= 1, "always something left to run"
        # its registered blocks carry its own hashes and tokens
        for i in range(kv.num_cached_blocks.get(req.request_id, 0)):
            toks = tuple(req.all_token_ids[i * bs : (i + 1) * bs])
            assert blocks[i].token_ids == toks
            assert blocks[i].block_hash == req.block_hashes[i]
        # and the (fake) K/V of every computed token is its own
        model.check_reads(req, [b.block_id for b in blocks], req.num_computed_tokens)
    for req in sched.waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert req.request_id not in kv.req_to_blocks
        assert kv.blocks_of(req.request_id) == []
        assert req.num_computed_tokens == 0
    # every cached block is full and holds what its hash says
    for h, block in kv.pool.cached.items():
        assert block.block_hash == h and len(block.token_ids) == bs


def replay_events(state: dict[bytes, tuple[int, ...]], events, bs: int) -> None:
    """Apply KV events as a subscriber would; a stored chain must link to what it names."""
    for event in events:
        if isinstance(event, BlockStored):
            assert len(event.token_ids) == bs * len(event.block_hashes)
            assert event.block_size == bs
            parent = event.parent_block_hash
            for i, h in enumerate(event.block_hashes):
                tokens = tuple(event.token_ids[i * bs : (i + 1) * bs])
                # the chain is the engine's own: a first block may carry the salt "a"
                salts = (b"", b"a") if parent is None else (b"",)
                assert h in {hash_block(parent, tokens, salt) for salt in salts}
                state[h] = tokens
                parent = h
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                del state[h]  # a removal names only what the index held
        else:
            assert isinstance(event, AllBlocksCleared)
            state.clear()


def drain(sched: Scheduler, model: FakeModel, max_steps: int = 2000) -> int:
    tokens = itertools.cycle(range(VOCAB))
    steps = 0
    while sched.has_unfinished():
        run_step(sched, model, tokens)
        check_scheduler_state(sched, model)
        steps += 1
        assert steps <= max_steps, "the scheduler makes no progress"
    return steps


class SchedulerMachine(RuleBasedStateMachine):
    CONFIG: dict[str, object] = {}  # SchedulerConfig fields beside the defaults

    def __init__(self) -> None:
        super().__init__()
        self.sched = make_scheduler(enable_kv_cache_events=True, **self.CONFIG)
        self.kv = self.sched.kv
        # what a KV-events subscriber knows: hash -> the tokens its BlockStored carried
        self.replayed: dict[bytes, tuple[int, ...]] = {}
        self.model = FakeModel(self.sched)
        self.ids = itertools.count()
        self.all_requests: dict[str, Request] = {}
        self.finished: set[str] = set()

    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(0, VOCAB - 1), max_size=40),
        max_tokens=st.integers(1, 8),
        cache_salt=st.sampled_from([None, "a"]),
        priority=st.integers(0, 3),
    )
    def add_request(self, prefix, tail, max_tokens, cache_salt, priority):
        prompt = (prefix + tail)[:40] or [0]
        rid = f"r{next(self.ids)}"
        req = Request(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            cache_salt=cache_salt,
            priority=priority,
        )
        self.sched.add_request(req)
        self.all_requests[rid] = req

    @rule(tokens=st.lists(st.integers(0, VOCAB - 1), min_size=MAX_NUM_SEQS, max_size=MAX_NUM_SEQS))
    def step(self, tokens):
        before = {rid: r.num_output_tokens for rid, r in self.sched.requests.items()}
        out = run_step(self.sched, self.model, itertools.cycle(tokens))
        for s in out.scheduled:
            req = self.all_requests[s.request_id]
            if s.samples:
                assert req.num_output_tokens == before[s.request_id] + 1
            if req.status.finished:
                assert req.status == RequestStatus.FINISHED_LENGTH
                assert req.num_output_tokens == req.sampling_params.max_tokens
                self.finished.add(s.request_id)

    @precondition(lambda self: self.sched.requests)
    @rule(idx=st.integers(0, 1000))
    def abort(self, idx):
        ids = sorted(self.sched.requests)
        req = self.sched.requests[ids[idx % len(ids)]]
        self.sched.finish(req, RequestStatus.FINISHED_ABORTED)
        assert req.status == RequestStatus.FINISHED_ABORTED
        assert req.request_id not in self.sched.requests
        assert req.request_id not in self.kv.req_to_blocks
        self.finished.add(req.request_id)

    @rule()
    def abort_unknown_or_finished(self):
        # finishing an already finished request again must not free anything twice
        done = [self.all_requests[r] for r in sorted(self.finished)]
        if done:
            used = self.kv.pool.num_used_blocks
            self.sched.finish(done[0], RequestStatus.FINISHED_ABORTED)
            assert self.kv.pool.num_used_blocks == used

    @rule()
    def flush_prefix_cache(self):
        held = {b.block_hash for b in self.kv.pool.blocks if b.ref_cnt > 0 and b.block_hash}
        self.kv.pool.reset_prefix_cache()
        assert set(self.kv.pool.cached) <= held, "a flush keeps only held blocks' hashes"

    @invariant()
    def consistent(self):
        check_scheduler_state(self.sched, self.model)

    @invariant()
    def kv_events_replay_to_the_index(self):
        replay_events(self.replayed, self.kv.take_events(), self.kv.block_size)
        cached = self.kv.pool.cached
        assert set(self.replayed) == set(cached)
        for h, tokens in self.replayed.items():
            assert cached[h].token_ids == tokens

    def teardown(self):
        drain(self.sched, self.model)
        for rid, req in self.all_requests.items():
            assert req.status.finished, rid
            if req.status == RequestStatus.FINISHED_LENGTH:
                assert req.num_output_tokens == req.sampling_params.max_tokens
        assert_all_free(self.kv)


SchedulerMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase
