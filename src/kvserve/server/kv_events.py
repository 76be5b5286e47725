"""KV events over ZMQ in vLLM's wire format, for routers that track each replica's cache exactly.

What goes out (vLLM 0.32's ``vllm/distributed/kv_events.py``, so a subscriber written for vLLM
reads kvserve unchanged):

- a PUB socket at ``endpoint``; each message is three frames ``(topic, seq, payload)``: the
  topic bytes, the batch's sequence number (8 bytes, big-endian, from 0), and a msgpack
  ``KVEventBatch`` = ``[ts, [event, ...], data_parallel_rank]``. Each event is a map tagged
  ``"type"``: ``BlockStored`` (block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name), ``BlockRemoved`` (block_hashes, medium) or
  ``AllBlocksCleared``. Hashes are kvserve's 32-byte sha256 block hashes (msgpack bin).
- with ``replay_endpoint``, a ROUTER socket: a client sends ``[b"", start_seq (8 bytes)]`` and
  gets every buffered ``[b"", seq, payload]`` from there on, then ``[b"", -1 (8 bytes), b""]``.

Endpoints follow vLLM's rule: one with ``*`` or ``::`` in it, or ``ipc://`` / ``inproc://``,
is bound; any other ``tcp://host:port`` is connected to (the subscriber binds). Events carry
prompt token ids: ``tcp://*:PORT`` exposes them on every interface, so prefer ``ipc://`` or a
firewall for anything past loopback.

``medium`` is "GPU" as vLLM (CPU builds included) names the engine's own KV pool; kvserve has
no other tier. ``extra_keys`` is not sent: the salts it would carry name tenants, and the
hashes already keep tenants apart.

One thread owns the sockets (ZMQ sockets are not thread-safe); the engine loop only hands it
the records (``publish``), never waits on the network.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from kvserve.kv import events as kv
from kvserve.server.config import KVEventsConfig

logger = logging.getLogger(__name__)

MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# -- the wire records: vLLM's, field for field ------------------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(event: kv.KVCacheEvent) -> KVCacheEvent:
    if isinstance(event, kv.BlockStored):
        return BlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            None,
            MEDIUM,
            None,
        )
    if isinstance(event, kv.BlockRemoved):
        return BlockRemoved(event.block_hashes, MEDIUM)
    return AllBlocksCleared()


def bind_or_connect(socket: zmq.Socket, endpoint: str) -> None:
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)


class ZmqEventPublisher:
    """PUB (+ ROUTER replay) on a thread of its own; ``publish`` never blocks the engine."""

    def __init__(self, config: KVEventsConfig, context: zmq.Context | None = None) -> None:
        self.config = config
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            bind_or_connect(self._pub, config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"cannot open the KV events endpoint: {e}") from e
        self._queue: queue.SimpleQueue[list[kv.KVCacheEvent] | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._encoder = msgspec.msgpack.Encoder()
        self.num_published = 0  # batches sent (the next batch's sequence number)
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)
        self._thread.start()
        logger.info(
            "KV events: publishing at %s%s",
            config.endpoint,
            f", replay at {config.replay_endpoint}" if config.replay_endpoint else "",
        )

    def publish(self, events: list[kv.KVCacheEvent]) -> None:
        """Queue one batch (the caller gives up the records); empty batches are not sent."""
        if events:
            self._queue.put(events)

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued (within ``timeout``), then close."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=500)  # a moment for the last batches to leave
        if self._replay is not None:
            self._replay.close(linger=0)
        if self._own_context:
            self._ctx.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError:
                    logger.exception("KV events: a replay request failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = self._encoder.encode(
                KVEventBatch(time.time(), [to_wire(e) for e in batch], 0)
            )
            seq = self.num_published
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                logger.exception("KV events: batch %d was not sent", seq)
            self._buffer.append((seq, payload))
            self.num_published += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning(
                "KV events: ignoring a malformed replay request (%d frames)", len(frames)
            )
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
