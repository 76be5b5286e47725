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
    """The tensors of one group of MLA layers (block axis 1).

    float latent:  ``latent`` (layers, num_blocks, block_size, rank + rope) in the spec's dtype
    fp8 latent:    ``latent.codes`` (..., rank) uint8 (float8_e4m3fn bits), ``latent.scales``
                   (..., 1) float16, ``latent.rope`` (..., rope) in ``rope_dtype``
    """

    def __init__(self, spec: MLASpec, num_layers: int, num_blocks: int, device, share=None) -> None:
        self.spec = spec
        if share is not None:  # a group of the same shape whose tensors this one uses
            self.tensors = share.tensors
            return
        lead = (num_layers, num_blocks, spec.block_size)
        # zeros: a padded read of a never-written slot must not see NaN garbage (masked, but
        # 0 * NaN would still poison the weighted sum)
        if not spec.dtype.is_quantized:
            self.tensors: dict[str, torch.Tensor] = {
                "latent": torch.zeros(
                    (*lead, spec.width), dtype=spec.dtype.code_dtype, device=device
                )
            }
            return
        assert spec.rope_dtype is not None
        rank, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
        self.tensors = {
            "latent.codes": torch.zeros((*lead, rank), dtype=torch.uint8, device=device),
            "latent.scales": torch.zeros(
                (*lead, spec.dtype.num_groups(rank)), dtype=torch.float16, device=device
            ),
            "latent.rope": torch.zeros(
                (*lead, rope), dtype=spec.rope_dtype.code_dtype, device=device
            ),
        }

    def block_dim(self, name: str) -> int:
        return 1

    @property
    def latent(self) -> torch.Tensor:
        """The float layout's one tensor (layers, num_blocks, block_size, width)."""
        return self.tensors["latent"]

    def write(self, index: int, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
        """rows (T, width) at slots (T,) of layer ``index`` of the group (fp8: quantized)."""
        if "latent" in self.tensors:
            dst = self.latent[index].view(-1, self.spec.width)
            dst.index_copy_(0, slot_mapping, rows.to(dst.dtype))
            return
        rank = self.spec.kv_lora_rank
        codes, scales, _ = self.spec.dtype.quantize(rows[:, :rank])
        for name, src in (("codes", codes), ("scales", scales), ("rope", rows[:, rank:])):
            dst = self.tensors[f"latent.{name}"][index]
            dst.view(-1, dst.shape[-1]).index_copy_(0, slot_mapping, src.to(dst.dtype))

    def _rows(self, index: int, select, dtype: torch.dtype) -> torch.Tensor:
        """The rows ``select`` picks from each tensor of layer ``index``, dequantized."""
        if "latent" in self.tensors:
            return select(self.latent[index])
        rank = self.spec.kv_lora_rank
        c = self.tensors
        latent = self.spec.dtype.dequantize(
            select(c["latent.codes"][index]), select(c["latent.scales"][index]), None, rank, dtype
        )
        return torch.cat((latent, select(c["latent.rope"][index]).to(dtype)), dim=-1)

    def gather(self, index: int, block_table: torch.Tensor) -> torch.Tensor:
        """block_table (b, nb) -> (b, nb * block_size, width), the blocks in order; rows past
        a request's length are whatever the slot holds (the caller masks them)."""
        return self._rows(index, lambda t: t[block_table].flatten(1, 2), self._dtype)

    def read_block(self, index: int, block_id: int, n: int) -> torch.Tensor:
        """The first ``n`` rows of one block (n, width): a view for a float latent."""
        return self._rows(index, lambda t: t[block_id, :n], self._dtype)

    @property
    def _dtype(self) -> torch.dtype:
        """What an fp8 latent dequantizes to: the rope key's float dtype (the model's)."""
        spec = self.spec
        return (spec.rope_dtype or spec.dtype).code_dtype


def group_for(spec):
    """The storage group class a layer spec takes (kv/storage.py picks by kind)."""
    return LatentGroup if getattr(spec, "kind", None) == MLASpec.kind else None
