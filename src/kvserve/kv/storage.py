"""KVCacheStorage: the K/V tensors of the paged cache, one allocation for all layers.

Layout: ``kv[0 = K | 1 = V, layer, block_id, offset, kv_head, head_dim]``. A token's slot is
``block_id * block_size + offset``; writes go through a slot mapping (one slot per token of
the step), reads through a request's block table.

    block table [7, 2, 9]   block_size 4
    token positions  0 1 2 3 | 4 5 6 7 | 8 9
    slots           28 .. 31 | 8 .. 11 | 36 37

The interface (``write``, ``key_cache`` / ``value_cache``, ``copy_blocks``, ``read_blocks`` /
``write_blocks`` (a saved prefix cache), ``nbytes``) is what a
quantized variant (codes + per-group scales, K and V in different dtypes), a sliding-window
variant or a latent (MLA) variant implements differently behind the same calls.
"""

from __future__ import annotations

import torch

from kvserve.kv.spec import KVCacheSpec


class KVCacheStorage:
    """Full-precision paged K/V for every layer."""

    def __init__(
        self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu"
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (2, spec.num_layers, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # zeros, not empty: a padded read of a never-written slot must not see NaN garbage
        # (it is masked, but 0 * NaN would still poison the softmax-weighted sum)
        self.kv = torch.zeros(shape, dtype=spec.dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    def key_cache(self, layer: int) -> torch.Tensor:
        """(num_blocks, block_size, num_kv_heads, head_dim)"""
        return self.kv[0, layer]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self.kv[1, layer]

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store k, v: (T, num_kv_heads, head_dim) at slots (T,)."""
        flat = (-1, self.spec.num_kv_heads, self.spec.head_dim)
        self.kv[0, layer].view(flat).index_copy_(0, slot_mapping, k.to(self.spec.dtype))
        self.kv[1, layer].view(flat).index_copy_(0, slot_mapping, v.to(self.spec.dtype))

    def read_blocks(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        """These blocks' contents in every layer, as named CPU tensors whose first dim is the
        block (what a saved prefix cache holds; a quantized layout would add its scales):
        ``kv`` is (len(block_ids), 2, num_layers, block_size, num_kv_heads, head_dim)."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)
        return {"kv": self.kv[:, :, ids].permute(2, 0, 1, 3, 4, 5).contiguous().cpu()}

    def write_blocks(self, block_ids: list[int], tensors: dict[str, torch.Tensor]) -> None:
        """The inverse of ``read_blocks``: ``tensors`` as it returned them, into these blocks."""
        kv = tensors.get("kv")
        if kv is None:
            raise ValueError(f"no 'kv' tensor among the saved blocks' {sorted(tensors)}")
        expected = (len(block_ids), *self.kv.shape[:2], *self.kv.shape[3:])
        if tuple(kv.shape) != expected or kv.dtype != self.kv.dtype:
            raise ValueError(
                f"blocks of shape {tuple(kv.shape)} {kv.dtype} do not fit this cache's "
                f"{expected} {self.kv.dtype}"
            )
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)
        self.kv[:, :, ids] = kv.permute(1, 2, 0, 3, 4, 5).to(self.kv.device)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks src[i] -> dst[i] in every layer (copy-on-write of a shared block)."""
        if src:
            s = torch.tensor(src, device=self.kv.device)
            d = torch.tensor(dst, device=self.kv.device)
            self.kv[:, :, d] = self.kv[:, :, s]
