"""The latent (MLA) layout of one group of layers: one row per token, no K/V split.

    latent  (layers, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)

A row is ``[normalized c_kv | rotated k_pe]`` (kv/spec.py ``MLASpec``): what absorbed decode
reads as its key (all of it) and value (the first ``kv_lora_rank`` values), and what expanded
attention multiplies by ``kv_b_proj``. Slots are the same ``block_id * block_size + offset``
as the K/V layout, so the block manager, prefix cache, copy-on-write and a saved cache work on
latent blocks unchanged: ``KVCacheStorage`` copies, reads and writes ``tensors`` by
``block_dim`` whatever the group's kind.
"""

from __future__ import annotations

import torch

from kvserve.kv.spec import MLASpec


class LatentGroup:
    """The tensor of one group of MLA layers (``tensors["latent"]``, block axis 1)."""

    def __init__(self, spec: MLASpec, num_layers: int, num_blocks: int, device) -> None:
        self.spec = spec
        # zeros: a padded read of a never-written slot must not see NaN garbage (masked, but
        # 0 * NaN would still poison the weighted sum)
        self.tensors: dict[str, torch.Tensor] = {
            "latent": torch.zeros(
                (num_layers, num_blocks, spec.block_size, spec.width),
                dtype=spec.dtype.code_dtype,
                device=device,
            )
        }

    def block_dim(self, name: str) -> int:
        return 1

    @property
    def latent(self) -> torch.Tensor:
        return self.tensors["latent"]

    def write(self, index: int, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
        """rows (T, width) at slots (T,) of layer ``index`` of the group."""
        dst = self.latent[index].view(-1, self.spec.width)
        dst.index_copy_(0, slot_mapping, rows.to(dst.dtype))

    def gather(self, index: int, block_table: torch.Tensor) -> torch.Tensor:
        """block_table (b, nb) -> (b, nb * block_size, width), the blocks in order; rows past
        a request's length are whatever the slot holds (the caller masks them)."""
        return self.latent[index][block_table].flatten(1, 2)

    def read_block(self, index: int, block_id: int, n: int) -> torch.Tensor:
        """The first ``n`` rows of one block (n, width): a view."""
        return self.latent[index, block_id, :n]


def group_for(spec):
    """The storage group class a layer spec takes (kv/storage.py picks by kind)."""
    return LatentGroup if getattr(spec, "kind", None) == MLASpec.kind else None
