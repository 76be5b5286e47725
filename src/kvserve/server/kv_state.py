"""``GET /v1/kv_state``: the block pool as the web view draws it, one small int per block.

``build_kv_state`` is a pure function over an ``LLMEngine``: it reads the pool, the block
tables and the prefix-cache index, so it must run where the engine is not stepping (the
server calls it through ``AsyncEngine.call``, on the loop thread between two steps).

A block is in exactly one state (``BlockState``):

    FREE    ref_cnt 0 and not in the prefix cache's index: the next allocation may take it
    USED    ref_cnt >= 1: in the block table of each request in ``block_requests[block]``
    CACHED  ref_cnt 0 but indexed: a prefix-cache hit until evicted (least recently freed
            first, kv/block_pool.py); a free block whose hash the index gives to another
            block is FREE (no lookup can reach it)

Compact on the wire: ``blocks`` is one int per block, and only USED blocks appear in
``block_requests``, as indices into ``requests`` (the ids of requests holding blocks). No
token ids leave the server: the view shows which request holds what, not what it holds.

With tenants (``--api-keys``) a caller without the admin role sees its own tenant's request
ids only (``viewer``): blocks that only other tenants' requests hold stay USED, held by one
anonymous entry, ``OTHER_TENANTS``, so the pool's occupancy still adds up.

``cache_dtypes`` is the exact bytes one token of one KV head takes per cache dtype and head
dim (``CacheDtype.bytes_per_head``: codes + float16 scales per group of 32), so the page's
calculator computes with the engine's own figures rather than a copy of the formats.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass

from kvserve.engine.engine import LLMEngine
from kvserve.kv.cache_dtype import CACHE_DTYPE_NAMES, CacheDtype
from kvserve.server.latency_window import LatencySummary
from kvserve.server.tenants import tenant_of_salt

# head dims the calculator offers (common checkpoints'), plus the served model's own
CALCULATOR_HEAD_DIMS = (32, 48, 64, 80, 96, 112, 128, 160, 192, 256)
CACHE_DTYPES = tuple(n for n in CACHE_DTYPE_NAMES if n != "auto")
# what a non-admin viewer sees in place of other tenants' request ids (never a request id:
# the server's are "cmpl-..." and "chatcmpl-...")
OTHER_TENANTS = "(other tenants)"


class BlockState(enum.IntEnum):
    FREE = 0
    USED = 1
    CACHED = 2


@dataclass(frozen=True, slots=True)
class SpecSummary:
    """The served cache's shape (``engine.spec``; the first group's layer spec, as every
    layer of the Llama family has one spec today)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    cache_dtype: str  # "bfloat16", "int8", or "int4_sym/int8" when K and V differ
    k_cache_dtype: str
    v_cache_dtype: str
    bytes_per_token: int  # every layer, K and V: exactly what the storage holds
    bytes_per_block: int


@dataclass(frozen=True, slots=True)
class PoolStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int  # FREE
    num_used_blocks: int  # USED
    num_cached_blocks: int  # CACHED (evictable)
    kv_cache_usage: float  # used / num_blocks, as /metrics' vllm:kv_cache_usage_perc
    prefix_cache_queries: int  # prompt tokens looked up since start
    prefix_cache_hits: int  # of those, tokens found
    prefix_cache_hit_rate: float | None  # hits / queries; None before the first lookup
    num_preemptions: int


@dataclass(frozen=True, slots=True)
class KVState:
    model: str
    max_model_len: int
    spec: SpecSummary
    num_blocks: int
    blocks: list[int]  # BlockState per block id
    requests: list[str]  # request ids holding blocks, in admission order
    block_requests: dict[int, list[int]]  # USED block id -> indices into requests
    stats: PoolStats
    latency: LatencySummary | None  # None: no latency window given (an engine alone)
    cache_dtypes: dict[str, dict[int, int]]  # dtype -> head dim -> bytes per token and head

    def to_json(self) -> dict:
        """Plain JSON types (the int keys of the maps become strings on the wire). The block
        list is passed as is: ``asdict`` would copy it an int at a time (40 ms at 64k blocks,
        on the event loop)."""
        return {
            "model": self.model,
            "max_model_len": self.max_model_len,
            "spec": asdict(self.spec),
            "num_blocks": self.num_blocks,
            "blocks": self.blocks,
            "requests": self.requests,
            "block_requests": self.block_requests,
            "stats": asdict(self.stats),
            "latency": None if self.latency is None else asdict(self.latency),
            "cache_dtypes": self.cache_dtypes,
        }


def dtype_table(head_dims: tuple[int, ...]) -> dict[str, dict[int, int]]:
    """Bytes per token and KV head for each cache dtype at each head dim it can hold."""
    table: dict[str, dict[int, int]] = {}
    for name in CACHE_DTYPES:
        dtype = CacheDtype(name)
        row = {}
        for d in head_dims:
            try:
                row[d] = dtype.bytes_per_head(d)
            except ValueError:  # int4_sym needs an even head dim
                continue
        table[name] = row
    return table


def spec_summary(engine: LLMEngine) -> SpecSummary:
    spec = engine.spec
    layer = spec.groups[0].spec
    return SpecSummary(
        num_layers=spec.num_layers,
        # a latent (MLA) layer caches one row of ``width`` values: one shared "head"
        num_kv_heads=getattr(layer, "num_kv_heads", 1),
        head_dim=getattr(layer, "head_dim", getattr(layer, "width", 0)),
        block_size=spec.block_size,
        cache_dtype=spec.cache_dtype_name,
        k_cache_dtype=layer.k_dtype.name,
        v_cache_dtype=layer.v_dtype.name,
        bytes_per_token=spec.bytes_per_token,
        bytes_per_block=spec.bytes_per_block,
    )


def _tenant_of_request(engine: LLMEngine, request_id: str) -> str | None:
    req = engine.scheduler.requests.get(request_id)
    return None if req is None else tenant_of_salt(req.cache_salt)


def build_kv_state(
    engine: LLMEngine,
    model_name: str,
    latency: LatencySummary | None = None,
    num_waiting: int | None = None,
    viewer: str | None = None,
) -> KVState:
    """The pool now. ``num_waiting``: the server's count (requests queued before the engine
    too, AsyncEngine.num_waiting); default the engine's own waiting queue. ``viewer``: the
    tenant asking, who sees only its own requests' ids; None sees every id (an admin, or a
    server without tenants)."""
    manager = engine.kv_manager
    pool = manager.pool
    # O(cached + used) rather than a Python step per block: a block's ref count is the number
    # of block tables holding it (KVCacheManager.check_integrity), so every USED block is in
    # one, and a CACHED one is the index's entry for its hash with no holder
    free, used, cached = int(BlockState.FREE), int(BlockState.USED), int(BlockState.CACHED)
    blocks = [free] * pool.num_blocks
    for b in pool.cached.values():
        if b.ref_cnt == 0:
            blocks[b.block_id] = cached
    requests: list[str] = []
    block_requests: dict[int, list[int]] = {}
    others: int | None = None  # the index of OTHER_TENANTS, once a hidden request holds blocks
    for rid in manager.req_to_blocks:  # every group's tables have the same requests
        table = manager.held_blocks(rid)  # all groups' blocks (none for window-passed entries)
        if not table:
            continue
        if viewer is None or _tenant_of_request(engine, rid) == viewer:
            index = len(requests)
            requests.append(rid)
        else:
            if others is None:
                others = len(requests)
                requests.append(OTHER_TENANTS)
            index = others
        for b in table:
            blocks[b.block_id] = used
            holders = block_requests.setdefault(b.block_id, [])
            if index not in holders:  # two hidden requests on one block: one entry
                holders.append(index)
    stats = engine.stats()
    num_cached = blocks.count(cached)
    queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
    spec = spec_summary(engine)
    head_dims = tuple(sorted({*CALCULATOR_HEAD_DIMS, spec.head_dim}))
    return KVState(
        model=model_name,
        max_model_len=engine.max_model_len,
        spec=spec,
        num_blocks=pool.num_blocks,
        blocks=blocks,
        requests=requests,
        block_requests=dict(sorted(block_requests.items())),
        stats=PoolStats(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting if num_waiting is None else num_waiting,
            num_free_blocks=pool.num_blocks - stats.num_used_blocks - num_cached,
            num_used_blocks=stats.num_used_blocks,
            num_cached_blocks=num_cached,
            kv_cache_usage=stats.kv_cache_usage,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            prefix_cache_hit_rate=hits / queries if queries else None,
            num_preemptions=stats.num_preemptions,
        ),
        latency=latency,
        cache_dtypes=dtype_table(head_dims),
    )
