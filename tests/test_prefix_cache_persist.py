"""A prefix cache that outlives the process (kv/persist.py, cache_fingerprint.py): saved blocks
reload into a fresh engine and serve exact hits; tenants stay apart; a file from another
engine (fingerprint), a torn file or an altered one is refused whole, with the reason; a small
pool takes the most recent blocks it can reach; and a real server keeps its cache across a
restart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_hf_checkpoint
from server_helpers import start_server

from kvserve.cache_fingerprint import cache_fingerprint
from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.engine.engine import LLMEngine
from kvserve.kv import persist
from kvserve.kv.cache_dtype import CacheDtype
from kvserve.kv.events import BlockStored
from kvserve.models.model_session import ModelSession
from kvserve.sampling import SamplingParams

BS = 4
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]  # 4 full blocks + 1 token


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> ModelSession:
    path, _ = make_hf_checkpoint(tmp_path_factory.mktemp("persist"), "llama")
    return ModelSession.open(path, "float32", "cpu")


def make_engine(session: ModelSession, num_blocks: int = 64, **cache) -> LLMEngine:
    return LLMEngine.from_session(
        session,
        CacheConfig(num_blocks=num_blocks, block_size=BS, **cache),
        SchedulerConfig(max_num_seqs=4),
        enforce_eager=True,
    )


def run(engine: LLMEngine, prompt: list[int], salt: str | None = None) -> tuple[list[int], int]:
    """Greedy tokens and the prompt tokens the prefix cache served."""
    engine.add_request(prompt, GREEDY, cache_salt=salt)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    (out,) = [o for o in outs if o.finished]
    return out.token_ids, out.num_cached_tokens


def saved(session: ModelSession, tmp_path: Path, *prompts: tuple[list[int], str | None]):
    engine = make_engine(session)
    results = [run(engine, p, s) for p, s in prompts]
    fingerprint = cache_fingerprint(session, engine.spec, None)
    report = persist.write(engine.snapshot_prefix_cache(), tmp_path, fingerprint)
    return engine, fingerprint, report, results


def test_reloaded_cache_serves_exact_hits_and_keeps_tenants_apart(
    session: ModelSession, tmp_path: Path
) -> None:
    a, fingerprint, report, [(tokens, cached)] = saved(session, tmp_path, (PROMPT, "tenant-1"))
    assert cached == 0 and report.num_blocks == len(a.kv_manager.pool.cached) > 0
    b = make_engine(session, enable_kv_cache_events=True)
    loaded = b.load_prefix_cache(tmp_path, fingerprint)
    assert loaded.refused is None and loaded.num_blocks == report.num_blocks
    assert set(b.kv_manager.pool.cached) == set(a.kv_manager.pool.cached)
    for h, block in b.kv_manager.pool.cached.items():  # the same K/V, bit for bit
        other = a.kv_manager.pool.cached[h]
        assert block.token_ids == other.token_ids
        assert torch.equal(
            b.storage.read_blocks([block.block_id])["kv"],
            a.storage.read_blocks([other.block_id])["kv"],
        )
    events = b.take_kv_events()
    assert all(isinstance(e, BlockStored) for e in events)
    announced: list[bytes | None] = [None]
    for e in events:  # a subscriber hears of each parent before its children
        assert e.parent_block_hash in announced
        announced += e.block_hashes
    assert set(announced[1:]) == set(b.kv_manager.pool.cached)
    assert len(events) == 1  # one prompt's chain: one event
    b.kv_manager.check_integrity()
    assert b.kv_manager.pool.num_free_blocks == b.kv_manager.pool.num_blocks  # evictable
    # another tenant's salt misses; the same tenant hits, with the tokens of a cold engine
    assert run(b, PROMPT, "tenant-2") == (tokens, 0)
    assert run(b, PROMPT, "tenant-1") == (tokens, 16)
    assert run(make_engine(session), PROMPT, "tenant-1") == (tokens, 0)


def test_a_file_from_another_engine_is_refused_naming_what_differs(
    session: ModelSession, tmp_path: Path
) -> None:
    _, fingerprint, _, _ = saved(session, tmp_path, (PROMPT, None))
    engine = LLMEngine.from_session(
        session, CacheConfig(num_blocks=64, block_size=8), enforce_eager=True
    )
    report = engine.load_prefix_cache(tmp_path, cache_fingerprint(session, engine.spec, None))
    assert report.num_blocks == 0 and "block_size differ" in report.refused
    b = make_engine(session)
    for key in ("weights_sha256", "tokenizer_sha256", "cache_dtype"):
        changed = dict(fingerprint, **{key: "something else"})
        report = b.load_prefix_cache(tmp_path, changed)
        assert report.num_blocks == 0 and report.refused == f"saved by another engine: {key} differ"
    assert b.kv_manager.pool.cached == {}


def test_blocks_that_cannot_be_filled_are_not_left_as_hits(
    session: ModelSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, fingerprint, _, _ = saved(session, tmp_path, (PROMPT, None))
    b = make_engine(session)

    def wrong_layout(block_ids, tensors):
        raise ValueError("blocks of another layout")

    monkeypatch.setattr(b.storage, "write_blocks", wrong_layout)
    report = b.load_prefix_cache(tmp_path, fingerprint)
    assert report.num_blocks == 0 and report.refused == "blocks of another layout"
    assert b.kv_manager.pool.cached == {}
    b.kv_manager.check_integrity()


def test_fingerprint_covers_weights_and_dtype(session: ModelSession, tmp_path: Path) -> None:
    spec = make_engine(session).spec
    base = cache_fingerprint(session, spec, None)
    assert base == cache_fingerprint(session, spec, None)
    other_path, _ = make_hf_checkpoint(tmp_path, "llama", seed=1)
    other = ModelSession.open(other_path, "float32", "cpu")
    assert cache_fingerprint(other, spec, None)["weights_sha256"] != base["weights_sha256"]
    int8 = session.model.kv_cache_spec(CacheDtype("int8"), CacheDtype("int8"))
    assert cache_fingerprint(session, int8, None)["cache_dtype"] == "int8"
    assert cache_fingerprint(session, int8, None)["layout"] != base["layout"]
    assert cache_fingerprint(session, spec, "q8_0")["quantization"] == "q8_0"


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_a_torn_or_altered_file_is_refused(
    session: ModelSession, tmp_path: Path, damage: str
) -> None:
    _, fingerprint, report, _ = saved(session, tmp_path, (PROMPT, None))
    data = bytearray(report.path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "flip":
        data[-10] ^= 0x01  # one bit of the last block's K/V
    else:
        data = bytearray(b"not a safetensors file at all")
    report.path.write_bytes(bytes(data))
    b = make_engine(session)
    got = b.load_prefix_cache(tmp_path, fingerprint)
    assert got.num_blocks == 0 and got.refused is not None
    assert ("checksum" in got.refused) if damage == "flip" else ("unreadable" in got.refused)
    assert b.kv_manager.pool.cached == {}
    b.kv_manager.check_integrity()


def test_a_small_pool_takes_the_most_recent_blocks(session: ModelSession, tmp_path: Path) -> None:
    first = [7] * 16  # 16 + 6 tokens, 21 computed: 5 full blocks
    second = [8] * 12 + [1]  # 13 + 6 tokens, 18 computed: 4 full blocks
    _, fingerprint, report, _ = saved(session, tmp_path, (first, None), (second, None))
    assert report.num_blocks == 5 + 4
    small = make_engine(session, num_blocks=5)
    got = small.load_prefix_cache(tmp_path, fingerprint)
    # saved in eviction order (each request freed tail first, the first request first): the
    # last 5 are the first prompt's head block and all of the second's
    assert got.refused is None and got.num_blocks == 5
    tokens = [b.token_ids for b in small.kv_manager.pool.cached.values()]
    assert sorted(tokens).count((8,) * 4) == 3 and (7,) * 4 in tokens
    small.kv_manager.check_integrity()
    assert run(small, second, None)[1] == 12


def test_only_blocks_reachable_from_a_first_block_load() -> None:
    def entry(name: str, parent: str | None) -> persist.Entry:
        return (name.encode() * 32, None if parent is None else parent.encode() * 32, (1,))

    entries = [entry("g", "c"), entry("o", "x"), entry("c", "r"), entry("r", None)]
    blocks = {"kv": torch.arange(4.0)}
    kept, kept_blocks = persist._fit(entries, blocks, room=10)
    assert kept == [entries[0], entries[2], entries[3]]  # the orphan "o" could never be hit
    assert kept_blocks["kv"].tolist() == [0.0, 2.0, 3.0]
    kept, _ = persist._fit(entries, blocks, room=2)  # the 2 most recent: c and its root
    assert kept == entries[2:]


def test_server_keeps_its_prefix_cache_across_a_restart(
    chat_checkpoint: Path, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "cache"
    args = ("--num-kv-blocks", "64", "--block-size", "16", "--prefix-cache-dir", str(cache_dir))
    prompt = "a system prompt that every request of this tenant repeats " * 6
    body = {"model": "tiny-chat", "prompt": prompt, "max_tokens": 2, "temperature": 0}

    def serve_once(*extra: str) -> tuple[dict, str, dict, str]:
        server = start_server(chat_checkpoint, tmp_path, *args, *extra)
        try:
            with server.http() as http:
                r = http.post("/v1/completions", json=body).json()
                save = http.post("/save_cache").json()
        finally:
            server.stop()
        return r["usage"], r["choices"][0]["text"], save, server.log()

    usage, text, save, _ = serve_once()
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0 and save["num_blocks_saved"] > 0
    warm, warm_text, _, log = serve_once()
    full_blocks = (usage["prompt_tokens"] - 1) // 16  # the last prompt token is always computed
    assert warm["prompt_tokens_details"]["cached_tokens"] == full_blocks * 16 > 0
    assert warm_text == text and "blocks loaded from" in log
    # another block size is another engine: the file is refused, nothing is hit
    cold, _, _, log = serve_once("--block-size", "32")
    assert cold["prompt_tokens_details"]["cached_tokens"] == 0
    assert "refused, nothing loaded: saved by another engine: block_size differ" in log
