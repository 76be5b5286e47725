"""KVCacheStorage: the tensors of the paged cache, and the only code that touches their layout.

Every reader and writer goes through this protocol:

- ``write(layer, slot_mapping, k, v)``: this step's K/V at their slots (quantized here when the
  side is stored quantized);
- ``gather(layer, block_table)``: a batch of requests' K/V, dequantized to the compute dtype
  (prefill chunks and the PyTorch decode path); ``read_block`` the first tokens of one block
  (the dense cache: one block of ``max_len`` tokens);
- ``plane(layer, side)``: one side as the C++ decode kernels read it in place (codes, scales);
- ``copy_blocks`` (copy-on-write: codes and scales alike), ``read_blocks`` / ``write_blocks``
  (a saved prefix cache), ``nbytes``.

A token's slot is ``block_id * block_size + offset``:

    block table [7, 2, 9]   block_size 4
    token positions  0 1 2 3 | 4 5 6 7 | 8 9
    slots           28 .. 31 | 8 .. 11 | 36 37

Layout, per group of layers with one spec (kv/spec.py), block dim after the layer dim:

    float K and V of one dtype:  kv        (2 = K | V, layers, num_blocks, block_size, kv_heads, head_dim)
    otherwise, per side s:       s.codes   (layers, num_blocks, block_size, kv_heads, code_bytes)
                                 s.scales  (layers, num_blocks, block_size, kv_heads, groups) float16
                                 s.mins    (same, int4 only)

The first layout is what the fused decode step (``kvserve::decode_layers``) takes whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kv.cache_dtype import CacheDtype
from kvserve.kv.latent_storage import group_for
from kvserve.kv.spec import KVCacheSpec

SIDES = ("k", "v")


@dataclass(slots=True)
class KVPlane:
    """One side (K or V) of one layer, as kernels read it in place.

    codes (num_blocks, block_size, kv_heads, code_bytes); scales / mins
    (num_blocks, block_size, kv_heads, groups) float16, or None where the format has none.
    """

    dtype: CacheDtype
    codes: torch.Tensor
    scales: torch.Tensor | None
    mins: torch.Tensor | None


class _Group:
    """The tensors of one group of layers; ``block_dim[name]`` is each one's block axis."""

    def __init__(self, spec, num_layers: int, num_blocks: int, device, share=None) -> None:
        self.spec = spec
        if share is not None:  # a group of the same shape: the same tensors (kv/spec.py groups)
            self.tensors = share.tensors
            return
        lead = (num_layers, num_blocks, spec.block_size, spec.num_kv_heads)
        d = spec.head_dim
        self.tensors: dict[str, torch.Tensor] = {}
        # zeros, not empty: a padded read of a never-written slot must not see NaN garbage
        # (it is masked, but 0 * NaN would still poison the softmax-weighted sum)
        if spec.k_dtype == spec.v_dtype and not spec.k_dtype.is_quantized:
            self.tensors["kv"] = torch.zeros(
                (2, *lead, d), dtype=spec.k_dtype.code_dtype, device=device
            )
            return
        for side, dt in zip(SIDES, (spec.k_dtype, spec.v_dtype), strict=True):
            self.tensors[f"{side}.codes"] = torch.zeros(
                (*lead, dt.code_bytes(d)), dtype=dt.code_dtype, device=device
            )
            if dt.is_quantized:
                shape = (*lead, dt.num_groups(d))
                self.tensors[f"{side}.scales"] = torch.zeros(
                    shape, dtype=torch.float16, device=device
                )
                if dt.name == "int4":
                    self.tensors[f"{side}.mins"] = torch.zeros(
                        shape, dtype=torch.float16, device=device
                    )

    def block_dim(self, name: str) -> int:
        return 2 if name == "kv" else 1

    def plane(self, index: int, side: str) -> KVPlane:
        dt = self.spec.k_dtype if side == "k" else self.spec.v_dtype
        if "kv" in self.tensors:
            return KVPlane(dt, self.tensors["kv"][SIDES.index(side), index], None, None)
        scales = self.tensors.get(f"{side}.scales")
        mins = self.tensors.get(f"{side}.mins")
        return KVPlane(
            dt,
            self.tensors[f"{side}.codes"][index],
            None if scales is None else scales[index],
            None if mins is None else mins[index],
        )


class KVCacheStorage:
    """The paged K/V of every layer. ``compute_dtype``: what dequantized reads return (the
    model's activation dtype; default: the first float side's dtype, else float32)."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        device: torch.device | str = "cpu",
        compute_dtype: torch.dtype | None = None,
        share_tensors: bool = True,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        # groups of one shape share tensors (a block id of the one pool belongs to one group
        # at a time); share_tensors=False gives each its own (a dense cache: one block each)
        shared = share_tensors and spec.shares_tensors
        self.groups: list[_Group] = []
        for g in spec.groups:
            share = self.groups[0] if self.groups and shared else None
            self.groups.append(
                (group_for(g.spec) or _Group)(g.spec, len(g.layers), num_blocks, device, share)
            )
        self._owners = [g for i, g in enumerate(self.groups) if i == 0 or not shared]
        self._where: list[tuple[int, int]] = [(0, 0)] * spec.num_layers  # layer -> (group, index)
        for gi, g in enumerate(spec.groups):
            for index, layer in enumerate(g.layers):
                self._where[layer] = (gi, index)
        if compute_dtype is None:
            floats = [d for layer in spec.layers for d in (layer.k_dtype, layer.v_dtype)]
            floats = [d.code_dtype for d in floats if not d.is_quantized]
            compute_dtype = floats[0] if floats else torch.float32
        self.compute_dtype = compute_dtype

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for g in self._owners for t in g.tensors.values())

    @property
    def kv(self) -> torch.Tensor | None:
        """The one (2, layers, num_blocks, block_size, kv_heads, head_dim) tensor when every
        layer stores K and V in one float dtype (what the fused decode step takes), else None."""
        if len(self.groups) == 1 and "kv" in self.groups[0].tensors:
            return self.groups[0].tensors["kv"]
        return None

    @property
    def is_quantized(self) -> bool:
        return any(
            d.is_quantized for layer in self.spec.layers for d in (layer.k_dtype, layer.v_dtype)
        )

    def plane(self, layer: int, side: str) -> KVPlane:
        gi, index = self._where[layer]
        return self.groups[gi].plane(index, side)

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store k, v: (T, num_kv_heads, head_dim) at slots (T,)."""
        for side, x in zip(SIDES, (k, v), strict=True):
            p = self.plane(layer, side)
            for dst, src in zip((p.codes, p.scales, p.mins), p.dtype.quantize(x), strict=True):
                if dst is not None:
                    dst.view(-1, *dst.shape[2:]).index_copy_(0, slot_mapping, src)

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block_table (b, nb) long -> k, v (b, nb * block_size, kv_heads, head_dim) in
        ``compute_dtype``: the tables' blocks in order, dequantized. Rows past a request's
        length are whatever the slot holds (zeros if never written): the caller masks them."""
        out = []
        for side in SIDES:
            p = self.plane(layer, side)
            parts = [
                None if t is None else t[block_table].flatten(1, 2)
                for t in (p.codes, p.scales, p.mins)
            ]
            head_dim = self.spec.layers[layer].head_dim
            out.append(p.dtype.dequantize(*parts, head_dim, self.compute_dtype))
        return out[0], out[1]

    def read_block(self, layer: int, block_id: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` tokens of one block: k, v (n, kv_heads, head_dim) in
        ``compute_dtype``; views for a float side (no copy), dequantized copies otherwise.
        The dense cache is one block of ``max_len`` tokens read this way."""
        out = []
        for side in SIDES:
            p = self.plane(layer, side)
            if not p.dtype.is_quantized and p.codes.dtype == self.compute_dtype:
                out.append(p.codes[block_id, :n])
                continue
            parts = [None if t is None else t[block_id, :n] for t in (p.codes, p.scales, p.mins)]
            head_dim = self.spec.layers[layer].head_dim
            out.append(p.dtype.dequantize(*parts, head_dim, self.compute_dtype))
        return out[0], out[1]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks src[i] -> dst[i] in every layer (copy-on-write of a shared block)."""
        if not src:
            return
        s = torch.tensor(src, device=self.device)
        d = torch.tensor(dst, device=self.device)
        for g in self._owners:
            for name, t in g.tensors.items():
                t.index_copy_(g.block_dim(name), d, t.index_select(g.block_dim(name), s))

    def group_of(self, layer: int) -> int:
        """The index of the group (kv/spec.py ``KVCacheSpec.groups``) layer ``layer`` is in:
        whose block table and slot mapping its reads and writes use."""
        return self._where[layer][0]

    def _named(self):
        single = len(self._owners) == 1
        for gi, g in enumerate(self._owners):
            for name, t in g.tensors.items():
                yield (name if single else f"g{gi}.{name}"), g.block_dim(name), t

    def read_blocks(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        """These blocks' contents in every layer, as named CPU tensors whose first dim is the
        block (what a saved prefix cache holds, codes and scales alike)."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return {
            name: t.index_select(dim, ids).movedim(dim, 0).contiguous().cpu()
            for name, dim, t in self._named()
        }

    def write_blocks(self, block_ids: list[int], tensors: dict[str, torch.Tensor]) -> None:
        """The inverse of ``read_blocks``: ``tensors`` as it returned them, into these blocks."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        named = list(self._named())
        if sorted(tensors) != sorted(n for n, _, _ in named):
            raise ValueError(
                f"the saved blocks hold {sorted(tensors)}, this cache {sorted(n for n, _, _ in named)}"
            )
        for name, dim, t in named:
            x = tensors[name]
            expected = (len(block_ids), *(s for i, s in enumerate(t.shape) if i != dim))
            if tuple(x.shape) != expected or x.dtype != t.dtype:
                raise ValueError(
                    f"saved {name!r} of shape {tuple(x.shape)} {x.dtype} does not fit this "
                    f"cache's {expected} {t.dtype}"
                )
        for name, dim, t in named:
            t.index_copy_(dim, ids, tensors[name].to(self.device).movedim(0, dim))

    # ---- the latent (MLA) layout: one row per token and layer (kv/latent_storage.py) -------

    def write_latent(self, layer: int, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
        """Store latent rows (T, kv_lora_rank + qk_rope_head_dim) at slots (T,)."""
        gi, index = self._where[layer]
        self.groups[gi].write(index, slot_mapping, rows)

    def gather_latent(self, layer: int, block_table: torch.Tensor) -> torch.Tensor:
        """block_table (b, nb) long -> latent rows (b, nb * block_size, width)."""
        gi, index = self._where[layer]
        return self.groups[gi].gather(index, block_table)

    def read_latent_block(self, layer: int, block_id: int, n: int) -> torch.Tensor:
        """The first ``n`` latent rows of one block (n, width), a view (the dense cache)."""
        gi, index = self._where[layer]
        return self.groups[gi].read_block(index, block_id, n)
