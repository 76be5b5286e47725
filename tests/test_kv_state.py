"""The web view's JSON (server/kv_state.py) against a real tiny engine: exact block ids and
states before, while and after requests (the pool hands out blocks from the head of its free
queue, 0, 1, 2, ... at first, and frees a request's blocks tail first), shared prefix blocks
listing every holder, and the latency window's medians."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
from conftest import make_hf_checkpoint, random_token_ids

from kvserve.engine.llm import LLM
from kvserve.engine.request import RequestOutput
from kvserve.models.model_session import ModelSession
from kvserve.sampling import SamplingParams
from kvserve.server.kv_state import BlockState, KVState, build_kv_state
from kvserve.server.latency_window import LatencyWindow

BLOCK = 4
NUM_BLOCKS = 32
FREE, USED, CACHED = BlockState.FREE, BlockState.USED, BlockState.CACHED


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> ModelSession:
    path, _ = make_hf_checkpoint(
        tmp_path_factory.mktemp("kv_state"),
        "llama",
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return ModelSession.open(path, "float32", "cpu")


@pytest.fixture
def llm(session: ModelSession) -> LLM:
    return LLM(session=session, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, enforce_eager=True)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def states(state: KVState) -> dict[int, BlockState]:
    """The blocks that are not free, by id."""
    return {i: BlockState(s) for i, s in enumerate(state.blocks) if s != FREE}


def run_to_end(llm: LLM) -> None:
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def test_an_idle_pool_is_all_free(llm: LLM) -> None:
    state = build_kv_state(llm.engine, "tiny")
    assert state.model == "tiny" and state.max_model_len == 128
    assert state.num_blocks == NUM_BLOCKS and state.blocks == [FREE] * NUM_BLOCKS
    assert state.requests == [] and state.block_requests == {}
    s = state.stats
    assert (s.num_free_blocks, s.num_used_blocks, s.num_cached_blocks) == (NUM_BLOCKS, 0, 0)
    assert s.prefix_cache_hit_rate is None and s.kv_cache_usage == 0.0
    assert state.latency is None


def test_the_spec_and_the_dtype_table_are_the_engines(llm: LLM) -> None:
    spec = build_kv_state(llm.engine, "tiny").spec
    # the tiny llama: 2 layers, 2 KV heads of 64 / 4 = 16, float32 K and V
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (2, 2, 16)
    assert (spec.cache_dtype, spec.k_cache_dtype, spec.v_cache_dtype) == ("float32",) * 3
    assert spec.bytes_per_token == 2 * 2 * 2 * 16 * 4  # K and V x layers x heads x dim x 4 B
    assert spec.block_size == BLOCK and spec.bytes_per_block == spec.bytes_per_token * BLOCK
    table = build_kv_state(llm.engine, "tiny").cache_dtypes
    # per token and head at head dim 128: codes + one float16 scale per group of 32
    assert table["float32"][128] == 512 and table["bfloat16"][128] == 256
    assert table["float16"][128] == 256
    assert table["int8"][128] == 128 + 4 * 2  # 34 bytes per 32 values
    assert table["int4_sym"][128] == 64 + 4 * 2  # 18 per 32
    assert table["int4"][128] == 64 + 2 * 4 * 2  # 20 per 32
    assert table["fp8_e4m3"][128] == 128 + 2  # one scale per token and head
    assert table["int8"][16] == 16 + 2  # a head under 32 values is one group
    assert sorted(table["float32"]) == [16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256]


def test_blocks_while_and_after_a_request(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request(random_token_ids(10, seed=1), greedy(6), request_id="a")
    waiting = build_kv_state(engine, "tiny")
    assert waiting.blocks == [FREE] * NUM_BLOCKS  # queued: no blocks yet
    assert (waiting.stats.num_waiting, waiting.stats.num_running) == (1, 0)

    engine.step()  # the 10-token prefill: blocks 0-2 (12 slots)
    running = build_kv_state(engine, "tiny")
    assert states(running) == {0: USED, 1: USED, 2: USED}
    assert running.requests == ["a"]
    assert running.block_requests == {0: [0], 1: [0], 2: [0]}
    assert (running.stats.num_running, running.stats.num_waiting) == (1, 0)
    assert running.stats.num_used_blocks == 3 and running.stats.kv_cache_usage == 3 / NUM_BLOCKS

    for _ in range(3):  # steps 2-4 compute positions 10-12: 12 needs a fourth block
        engine.step()
    assert states(build_kv_state(engine, "tiny")) == {i: USED for i in range(4)}

    run_to_end(llm)
    done = build_kv_state(engine, "tiny")
    # 10 + 6 tokens, 15 of them computed (the last one never is): 3 full blocks stay cached,
    # the fourth (positions 12-15, never full) is plain free
    assert states(done) == {0: CACHED, 1: CACHED, 2: CACHED}
    assert done.requests == [] and done.block_requests == {}
    s = done.stats
    assert (s.num_free_blocks, s.num_used_blocks, s.num_cached_blocks) == (NUM_BLOCKS - 3, 0, 3)
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.prefix_cache_hit_rate) == (10, 0, 0.0)


def test_shared_prefix_blocks_list_every_holder(llm: LLM) -> None:
    engine = llm.engine
    prefix = random_token_ids(8, seed=2)
    engine.add_request(prefix + [5, 6], greedy(1), request_id="first")
    run_to_end(llm)
    assert states(build_kv_state(engine, "tiny")) == {0: CACHED, 1: CACHED}
    # two requests on the cached 8-token prefix: both hold blocks 0 and 1; each gets its own
    # third block from the free queue's head (3, 4, ...: 2, 1, 0 were freed last, behind them)
    engine.add_request(prefix + [7, 8], greedy(4), request_id="b")
    engine.add_request(prefix + [9, 10], greedy(4), request_id="c")
    engine.step()
    state = build_kv_state(engine, "tiny", num_waiting=7)
    assert state.requests == ["b", "c"]
    assert state.block_requests == {0: [0, 1], 1: [0, 1], 3: [0], 4: [1]}
    assert states(state) == {0: USED, 1: USED, 3: USED, 4: USED}
    assert state.stats.num_waiting == 7  # the server's own count, when given
    run_to_end(llm)
    done = build_kv_state(engine, "tiny")
    # b's and c's third blocks filled (positions 8-11 of 14 tokens, 13 computed); their fourth
    # never did, nor did block 2 (first: 11 tokens, 10 computed)
    assert states(done) == {0: CACHED, 1: CACHED, 3: CACHED, 4: CACHED}
    assert done.stats.prefix_cache_hits == 16 and done.stats.prefix_cache_queries == 30
    assert done.stats.prefix_cache_hit_rate == 16 / 30


def test_to_json_is_compact_plain_json(llm: LLM) -> None:
    llm.engine.add_request(random_token_ids(6, seed=3), greedy(2), request_id="r")
    llm.engine.step()
    wire = json.loads(json.dumps(build_kv_state(llm.engine, "tiny").to_json()))
    assert list(wire) == [f.name for f in fields(KVState)]
    assert wire["blocks"][:3] == [1, 1, 0] and wire["block_requests"] == {"0": [0], "1": [0]}
    assert wire["cache_dtypes"]["int4_sym"]["128"] == 72


def final(ttft: float, decode: float, tokens: int, reason: str = "length") -> RequestOutput:
    return RequestOutput(
        request_id="x", prompt_token_ids=[1], new_token_ids=[], new_text="", new_logprobs=None,
        finished=True, finish_reason=reason, token_ids=list(range(tokens)), text="",
        logprobs=None, num_cached_tokens=0, queue_time_s=0.0, ttft_s=ttft, decode_time_s=decode,
    )  # fmt: skip


def test_the_latency_window_keeps_the_last_sequences_exactly() -> None:
    window = LatencyWindow(size=3)
    empty = window.summary()
    assert (empty.num_ttft, empty.ttft_median_s, empty.tpot_last_s) == (0, None, None)
    window.record(final(0.5, 1.0, 11))  # TPOT 0.1
    window.record(final(0.1, 0.0, 1))  # one token: no TPOT
    window.record(final(9.0, 9.0, 4, reason="abort"))  # not a latency a client saw
    window.record(final(0.2, 0.6, 4))  # TPOT 0.2
    window.record(final(0.3, 1.2, 5))  # TPOT 0.3; TTFT 0.5 drops out of the window of 3
    s = window.summary()
    assert (s.window, s.num_ttft, s.num_tpot) == (3, 3, 3)
    assert s.ttft_median_s == 0.2 and s.ttft_last_s == 0.3
    assert s.tpot_median_s == pytest.approx(0.2) and s.tpot_last_s == pytest.approx(0.3)
    with pytest.raises(ValueError, match="latency window"):
        LatencyWindow(size=0)
