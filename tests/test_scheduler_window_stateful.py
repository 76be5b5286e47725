"""Scheduler + KVCacheManager with windowed cache groups, driven without a model (hypothesis).

Three groups share one pool: full attention, a sliding window of 6, and a window of 5 with 2
attention sinks. A fake model writes every scheduled token id into its group's slots and checks
that each query reads back its own tokens at every position its group lets it see (all of them,
the window, or the sinks and the window), so a window-passed block given back too early, a
windowed prefix hit missing a block it needs, or a block reused while another group still
reads it shows up as a wrong token. ``check_integrity`` runs after every step; between steps a
windowed group holds no more blocks than its window (plus the step's chunk) spans.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvserve.config import SchedulerConfig
from kvserve.engine.output import append_token
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.intmath import cdiv
from kvserve.kv.cache_dtype import CacheDtype
from kvserve.kv.manager import NULL_BLOCK, KVCacheManager
from kvserve.kv.spec import FullAttentionSpec, SlidingWindowSpec
from kvserve.sampling import SamplingParams

BS = 4
MAX_BATCHED = 12
F32 = CacheDtype.of(torch.float32)
SPECS = (
    FullAttentionSpec(1, 8, F32, F32, BS),
    SlidingWindowSpec(1, 8, F32, F32, BS, sliding_window=6),
    SlidingWindowSpec(1, 8, F32, F32, BS, sliding_window=5, num_sinks=2),
)
PREFIXES = ([], [0, 1, 2, 0, 1, 2, 0, 1], [2, 2, 1, 1, 0, 0, 2, 2, 1, 1, 0, 0, 1, 2])


def visible(spec, q: int) -> list[int]:
    if spec.sliding_window is None:
        return list(range(q + 1))
    return [k for k in range(q + 1) if k > q - spec.sliding_window or k < spec.num_sinks]


class FakeModel:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.slots: dict[int, int] = {}  # a block belongs to one group: slot ids are unique

    def execute(self, out: SchedulerOutput) -> None:
        for src, dst in out.block_copies:
            for off in range(BS):
                if src * BS + off in self.slots:
                    self.slots[dst * BS + off] = self.slots[src * BS + off]
                else:
                    self.slots.pop(dst * BS + off, None)
        for s in out.scheduled:
            req = self.sched.requests[s.request_id]
            end = s.num_computed_tokens + s.num_new_tokens
            for table in s.block_tables:
                assert len(table) * BS >= end, "block table too short for the step"
                for pos in range(s.num_computed_tokens, end):
                    assert table[pos // BS] >= 0, f"writing position {pos} into a null entry"
                    self.slots[table[pos // BS] * BS + pos % BS] = req.all_token_ids[pos]
        for s in out.scheduled:
            req = self.sched.requests[s.request_id]
            for spec, table in zip(SPECS, s.block_tables, strict=True):
                for q in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                    for k in visible(spec, q):
                        block = table[k // BS]
                        got = None if block < 0 else self.slots.get(block * BS + k % BS)
                        assert got == req.all_token_ids[k], (
                            f"{req.request_id} ({spec.describe()}): query {q} reads {got} at "
                            f"{k}, expected {req.all_token_ids[k]} (table {table})"
                        )


class WindowMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # 28 blocks: the longest request (34 + 12 tokens) fits alone in every group at once
        kv = KVCacheManager(28, BS, True, False, SPECS)
        config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=MAX_BATCHED)
        self.sched = Scheduler(config, kv, 200)
        self.kv = kv
        self.model = FakeModel(self.sched)
        self.ids = itertools.count()
        self.all: dict[str, Request] = {}

    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(0, 2), max_size=20),
        max_tokens=st.integers(1, 12),
    )
    def add_request(self, prefix, tail, max_tokens):
        rid = f"r{next(self.ids)}"
        req = Request(
            request_id=rid,
            prompt_token_ids=(prefix + tail) or [0],
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        self.sched.add_request(req)
        self.all[rid] = req

    @rule(tokens=st.lists(st.integers(0, 2), min_size=3, max_size=3))
    def step(self, tokens):
        out = self.sched.schedule()
        self.model.execute(out)
        self.sched.update_after_step(out)
        self.kv.check_integrity()
        cycle = itertools.cycle(tokens)
        for s in out.scheduled:
            if s.samples:
                req = self.sched.requests[s.request_id]
                status = append_token(req, next(cycle), None, self.sched.max_model_len)
                if status is not None:
                    self.sched.finish(req, status)
        self.kv.check_integrity()

    @rule(idx=st.integers(0, 100))
    def abort(self, idx):
        ids = sorted(self.sched.requests)
        if ids:
            self.sched.finish(
                self.sched.requests[ids[idx % len(ids)]], RequestStatus.FINISHED_ABORTED
            )

    @invariant()
    def bounded_and_consistent(self):
        self.kv.check_integrity()
        for req in self.sched.running:
            for g, spec in enumerate(SPECS):
                table = self.kv.blocks_of(req.request_id, g)
                assert len(table) == cdiv(req.num_computed_tokens, BS)
                held = sum(b is not NULL_BLOCK for b in table)
                if spec.sliding_window is not None:
                    bound = spec.sink_blocks + cdiv(spec.sliding_window + MAX_BATCHED, BS) + 1
                    assert held <= bound, (req.request_id, g, held, bound)
                else:
                    assert held == len(table)

    def teardown(self):
        steps = 0
        while self.sched.has_unfinished():
            self.step([0, 1, 2])
            steps += 1
            assert steps < 2000, "no progress"
        pool = self.kv.pool
        assert pool.num_free_blocks == pool.num_blocks
        assert all(t == {} for t in self.kv.tables)


WindowMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestWindowScheduler = WindowMachine.TestCase
