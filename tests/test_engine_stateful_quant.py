"""The bookkeeping state machine on a real engine with a quantized cache (K int4, V int8):
random interleavings of requests sharing prefixes (prefix hits), n = 2 samples (fork and
copy-on-write), aborts and steps in a pool small enough to preempt. After every rule the
engine's integrity holds; every request that finishes by length has exactly the greedy tokens
of the same prompt run alone on a fresh engine with the same quantized cache; at the end,
nothing leaks."""

from __future__ import annotations

import itertools

import pytest
from conftest import make_hf_checkpoint, random_token_ids
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvserve.engine.llm import LLM
from kvserve.models.model_session import ModelSession
from kvserve.sampling import SamplingParams

BLOCK, MAX_TOKENS = 4, 6
CACHE = dict(k_cache_dtype="int4", v_cache_dtype="int8", block_size=BLOCK)
PREFIXES = [random_token_ids(n, seed=70 + n) for n in (0, 5, 9, 13)]


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> ModelSession:
    path, _ = make_hf_checkpoint(
        tmp_path_factory.mktemp("kvq-sm"),
        "llama",
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return ModelSession.open(path, "float32", "cpu")


def test_engine_state_machine_on_quantized_blocks(session: ModelSession) -> None:
    alone: dict[tuple[int, ...], list[int]] = {}  # prompt -> its tokens run alone
    seen = {"preemptions": 0, "hits": 0, "checked": 0}  # what the examples exercised

    def reference(prompt: tuple[int, ...]) -> list[int]:
        if prompt not in alone:
            llm = LLM(session=session, num_kv_blocks=64, enable_prefix_caching=False, **CACHE)
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            alone[prompt] = llm.generate([list(prompt)], params, use_tqdm=False)[0].token_ids
        return alone[prompt]

    class Machine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            # 14 blocks of 4: a few requests of ~20 + 6 tokens outgrow it (preemption)
            self.llm = LLM(session=session, num_kv_blocks=14, max_num_seqs=4, **CACHE)
            self.engine = self.llm.engine
            self.ids = itertools.count()
            self.prompts: dict[str, tuple[int, ...]] = {}
            self.live: list[str] = []

        @rule(
            prefix=st.sampled_from(PREFIXES),
            tail=st.lists(st.integers(0, 99), min_size=1, max_size=8),
            n=st.sampled_from([1, 1, 2]),
        )
        def add(self, prefix, tail, n):
            prompt = tuple(prefix + tail)
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, n=n, ignore_eos=True)
            rid = f"q{next(self.ids)}"
            self.engine.add_request(list(prompt), params, request_id=rid)
            self.prompts[rid] = prompt
            self.live.append(rid)

        @precondition(lambda self: self.engine.has_unfinished_requests())
        @rule()
        def step(self):
            for out in self.engine.step():
                if out.finished and out.finish_reason == "length":
                    root = out.parent_request_id or out.request_id
                    assert out.token_ids == reference(self.prompts[root]), out.request_id
                    seen["checked"] += 1
                    seen["hits"] += out.num_cached_tokens > 0

        @precondition(lambda self: self.live)
        @rule(idx=st.integers(0, 100))
        def abort(self, idx):
            self.engine.abort_request(self.live.pop(idx % len(self.live)))

        @invariant()
        def integrity(self):
            self.engine.check_integrity()

        def teardown(self):
            steps = 0
            while self.engine.has_unfinished_requests():
                self.step()
                steps += 1
                assert steps < 500, "the engine makes no progress"
            seen["preemptions"] += self.engine.stats().num_preemptions
            pool = self.engine.kv_manager.pool
            assert pool.num_free_blocks == pool.num_blocks
            assert all(b.ref_cnt == 0 for b in pool.blocks)

    Machine.TestCase.settings = settings(
        max_examples=12,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    Machine.TestCase().runTest()
    assert seen["checked"] > 0 and seen["hits"] > 0 and seen["preemptions"] > 0, seen
