"""KV events: the pool records every change to its prefix-cache index (kv/events.py), the
publisher sends them in vLLM's wire format over ZMQ (server/kv_events.py), and a subscriber
that replays them rebuilds exactly the pool's cached-block set: at the pool, through a real
engine under eviction pressure, a flush and a rebuilt pool, over ZMQ from an AsyncEngine, and
from a real `kvserve serve`."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from conftest import make_hf_checkpoint
from msgspec.msgpack import Decoder
from server_helpers import start_server

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.engine.engine import LLMEngine
from kvserve.kv import events as kv
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.manager import KVCacheManager
from kvserve.models.model_session import ModelSession
from kvserve.sampling import SamplingParams
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.config import KVEventsConfig
from kvserve.server.engine_records import PromptSpec
from kvserve.server.kv_events import ZmqEventPublisher


# -- a subscriber's own types: vLLM's example subscriber's (examples/online_serving/
# kv_events_subscriber.py), not kvserve's, so the test checks the wire, not our own encoder
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = Decoder(type=KVEventBatch)


def apply(state: set[bytes], batch: KVEventBatch) -> None:
    for e in batch.events:
        if isinstance(e, BlockStored):
            assert len(e.token_ids) == e.block_size * len(e.block_hashes)
            state.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            state.difference_update(e.block_hashes)
        else:
            state.clear()


def h(name: str) -> bytes:
    return name.encode().ljust(32, b".")


# -- the pool records exactly its index --------------------------------------------------------
def test_pool_events_follow_the_index() -> None:
    log = kv.KVEventLog(enabled=True)
    pool = BlockPool(3, events=log)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_block(a, h("a"), (1, 2), None)
    pool.cache_full_block(b, h("b"), (3, 4), h("a"))  # the same chain: one event
    pool.cache_full_block(c, h("a"), (1, 2), None)  # a duplicate: the index keeps a's
    assert log.take() == [kv.BlockStored([h("a"), h("b")], None, [1, 2, 3, 4], 2)]
    pool.free_blocks([c, b, a])
    (new,) = pool.get_new_blocks(1)  # takes c: its hash was never indexed
    assert new is c and log.take() == []
    pool.get_new_blocks(1)  # evicts b
    assert log.take() == [kv.BlockRemoved([h("b")])]
    assert pool.reset_prefix_cache() == 1  # a is free: dropped, the index is empty
    assert log.take() == [kv.AllBlocksCleared()]
    assert pool.cached == {}


def test_partial_flush_removes_only_free_blocks_and_reset_clears() -> None:
    mgr = KVCacheManager(4, 2, enable_kv_cache_events=True)
    held, free = mgr.pool.get_new_blocks(2)
    mgr.pool.cache_full_block(held, h("held"), (1, 1))
    mgr.pool.cache_full_block(free, h("free"), (2, 2))
    mgr.pool.free_blocks([free])
    mgr.take_events()
    mgr.pool.reset_prefix_cache()
    assert mgr.take_events() == [kv.BlockRemoved([h("free")])]
    assert set(mgr.pool.cached) == {h("held")}
    mgr.reset()  # a rebuilt pool after a failure: subscribers start over
    assert mgr.take_events() == [kv.AllBlocksCleared()]


def test_events_off_record_nothing() -> None:
    mgr = KVCacheManager(4, 2)
    (block,) = mgr.pool.get_new_blocks(1)
    mgr.pool.cache_full_block(block, h("x"), (1, 1))
    mgr.pool.reset_prefix_cache()
    assert mgr.take_events() == []


# -- through an engine -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> ModelSession:
    path, _ = make_hf_checkpoint(tmp_path_factory.mktemp("events"), "llama")
    return ModelSession.open(path, "float32", "cpu")


def make_engine(session: ModelSession, num_blocks: int = 24) -> LLMEngine:
    return LLMEngine.from_session(
        session,
        CacheConfig(num_blocks=num_blocks, block_size=4, enable_kv_cache_events=True),
        SchedulerConfig(max_num_seqs=3),
        enforce_eager=True,
    )


def test_engine_events_replay_to_the_pool_after_every_step(session: ModelSession) -> None:
    engine = make_engine(session)
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)
    prefixes = ([7] * 12, [9, 8] * 6, [3, 1, 4, 1, 5, 9, 2, 6])
    state: set[bytes] = set()
    saw = set()
    for i in range(18):  # 24 blocks of 4: the later requests evict the earlier ones' blocks
        engine.add_request(prefixes[i % 3] + [i, i + 1, i + 2], params)
        while engine.has_unfinished_requests():
            engine.step()
            events = engine.take_kv_events()
            saw.update(type(e) for e in events)
            state = kv.replay(events, state)
            assert state == set(engine.kv_manager.pool.cached)
    assert saw == {kv.BlockStored, kv.BlockRemoved}
    engine.reset_prefix_cache()
    assert kv.replay(engine.take_kv_events(), state) == set() == set(engine.kv_manager.pool.cached)


def subscribe(ctx: zmq.Context, endpoint: str, topic: bytes = b"") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.connect(endpoint)
    return sub


def replay_from(req: zmq.Socket, first: int) -> list[tuple[int, bytes]]:
    """The publisher's buffered batches from sequence number ``first`` on."""
    req.send_multipart((b"", first.to_bytes(8, "big")))
    batches = []
    while True:
        _, seq, payload = req.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            return batches
        batches.append((int.from_bytes(seq, "big"), payload))


class Subscriber:
    """vLLM's subscriber protocol: live batches from SUB, and a gap (a batch sent before the
    subscription reached the publisher: ZMQ's "slow joiner", or dropped) filled from the replay
    socket. ``seqs`` are the sequence numbers applied, in order."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay_endpoint: str) -> None:
        self.sub = subscribe(ctx, endpoint, b"kv")
        self.sub.setsockopt(zmq.RCVTIMEO, 500)
        self.req = ctx.socket(zmq.DEALER)
        self.req.setsockopt(zmq.RCVTIMEO, 10_000)
        self.req.connect(replay_endpoint)
        self.seqs: list[int] = []

    def _apply(self, state: set[bytes], seq: int, payload: bytes) -> None:
        self.seqs.append(seq)
        apply(state, DECODER.decode(payload))

    def receive(self, state: set[bytes], until, timeout: float = 20.0) -> None:
        """Apply batches until ``until(state)``."""
        deadline = time.monotonic() + timeout
        while not until(state):
            assert time.monotonic() < deadline, f"no state satisfied the test after {self.seqs}"
            try:
                _, seq_bytes, payload = self.sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
            except zmq.Again:  # quiet: anything sent but not heard is in the replay buffer
                seq, payload = None, b""
            if seq is not None and seq < len(self.seqs):
                continue  # already applied from a replay
            if seq is None or seq > len(self.seqs):
                for s, p in replay_from(self.req, len(self.seqs)):
                    if s == len(self.seqs):
                        self._apply(state, s, p)
            if seq is not None and seq == len(self.seqs):
                self._apply(state, seq, payload)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.req.close(linger=0)


def test_zmq_subscriber_rebuilds_an_async_engines_pool(
    session: ModelSession, tmp_path: Path
) -> None:
    endpoint = f"ipc://{tmp_path}/events"
    replay_endpoint = f"ipc://{tmp_path}/replay"
    publisher = ZmqEventPublisher(KVEventsConfig(endpoint, replay_endpoint, topic="kv"))
    ctx = zmq.Context()
    subscriber = Subscriber(ctx, endpoint, replay_endpoint)
    engine = make_engine(session)
    loop_engine = AsyncEngine(engine, publish_kv_events=publisher.publish)
    loop_engine.start()
    try:

        async def run() -> None:
            params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
            for i in range(12):
                stream = loop_engine.submit([PromptSpec([5] * 10 + [i] * 6, params)])
                async for _ in stream:
                    pass

        asyncio.run(run())
        pool = engine.kv_manager.pool
        # the loop is idle now (every stream ended): the pool no longer changes
        state: set[bytes] = set()
        subscriber.receive(state, lambda s: s == set(pool.cached) and len(s) > 0)
        flushed = asyncio.run(loop_engine.flush_prefix_cache())
        assert flushed > 0
        subscriber.receive(state, lambda s: not s)
        # a late subscriber fetches the whole history from the replay socket
        replayed: set[bytes] = set()
        got = []
        for seq, payload in replay_from(subscriber.req, 0):
            got.append(seq)
            apply(replayed, DECODER.decode(payload))
        assert got == list(range(publisher.num_published)) and replayed == set()
    finally:
        loop_engine.shutdown()
        publisher.shutdown()
        subscriber.close()
        ctx.term()


def test_a_real_server_publishes_its_prompt_blocks(chat_checkpoint: Path, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/server-events"
    args = ("--num-kv-blocks", "64", "--block-size", "16", "--kv-events-endpoint", endpoint)
    server = start_server(chat_checkpoint, tmp_path, *args)
    ctx = zmq.Context()
    sub = subscribe(ctx, endpoint)
    try:
        with server.http() as http:
            prompt = "the cache is a memory manager " * 12
            ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
            stored: list[BlockStored] = []
            done = threading.Event()

            def listen() -> None:
                while not done.is_set():
                    try:
                        _, _, payload = sub.recv_multipart()
                    except zmq.Again:
                        continue
                    stored.extend(
                        e for e in DECODER.decode(payload).events if isinstance(e, BlockStored)
                    )
                    if sum(len(e.block_hashes) for e in stored) >= len(ids) // 16:
                        done.set()

            # a SUB socket misses what was sent before it connected: send until one is heard
            listener = threading.Thread(target=listen)
            listener.start()
            for _ in range(20):
                if done.is_set():
                    break
                body = {"model": server.model, "prompt": prompt, "max_tokens": 1}
                assert http.post("/v1/completions", json=body).status_code == 200
                http.post("/flush_cache")
                done.wait(0.5)
            done.set()
            listener.join()
        tokens = [t for e in stored for t in e.token_ids]
        assert tokens[: (len(ids) // 16) * 16] == ids[: (len(ids) // 16) * 16]
        assert stored[0].parent_block_hash is None and stored[0].medium == "GPU"
    finally:
        server.stop()
        sub.close(linger=0)
        ctx.term()


def test_each_cluster_replica_gets_its_own_endpoint_and_cache_dir() -> None:
    from kvserve.cluster import replica_serve_args

    args = ["--kv-events-endpoint", "tcp://*:5557", "--prefix-cache-dir=/d", "--dtype", "float32"]
    assert replica_serve_args(args, 0) == [
        "--kv-events-endpoint", "tcp://*:5557", "--prefix-cache-dir=/d/replica-0", "--dtype", "float32",
    ]  # fmt: skip
    assert replica_serve_args(args, 2)[:3] == [
        "--kv-events-endpoint", "tcp://*:5559", "--prefix-cache-dir=/d/replica-2",
    ]  # fmt: skip
    assert replica_serve_args(["--kv-events-endpoint", "ipc:///tmp/kv"], 1) == [
        "--kv-events-endpoint", "ipc:///tmp/kv_dp1",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="end in a port"):
        KVEventsConfig("tcp://*:notaport")
    with pytest.raises(ValueError, match="must start with one of"):
        KVEventsConfig("http://localhost:5557")
