"""The fused step: every decoder layer of a batch of token rows in one C++ call.

A decode step of the default model at batch 1 is ~4 ms of quantized matmuls; run layer by
layer from Python (eager or compiled halves) it made ~600 PyTorch calls and their dispatch
cost about as much again. ``kvserve::decode_layers`` (kernels/csrc/decode_layers.cpp) runs
norm -> q/k/v -> rotary -> cache write -> paged attention -> o_proj -> norm -> MLP for all
layers over raw buffers, with the same kernels the eager layers call (``quant_matmul``,
``paged_decode_attention``), so a step is one call between the embedding and the final norm.

When it runs (``FusedDecode.build`` says why not, once, at debug level):

- the C++ kernels are loaded (not ``KVSERVE_KERNELS=0``), model and cache on CPU;
- every layer's projections are quantized (a GGUF model or ``--quantization``), with no biases
  and no q/k norm (Llama, Mistral, SmolLM). q/k/v and gate/up are fused where their types
  agree; where they do not (a Q4_K_M file: Q4_K beside Q6_K) each part is its own weight slot;
- the step is all decodes, and no more rows than every weight's measured kernel threshold
  (above it the eager path's dequantize + GEMM is faster). A bfloat16 model on an
  AVX-512-BF16 CPU multiplies each weight through the float32 or the bf16 kernel, whichever
  ``QuantPolicy.path`` picks at the step's row count (the bf16 one through AMX tiles where
  the CPU has them), as the eager layers would.

With every weight's policy in the bf16 kernel's fixed order (``every_step``: batch-invariant
mode, ``fixed_order.fix_summation_order``) it runs every step, prefill and mixed ones too: a
prefill token is one more row, attending through the decode kernel over its request's blocks up
to its own position. Then a token's arithmetic does not depend on the step it ran in (its
batch, its chunk, a prefix hit): the bitwise-invariant default path (ARCHITECTURE.md).

Activations stay float32 inside (a bfloat16 model's eager layers round them to bfloat16 after
each op), the cache is written in its own dtype. The eager layers are the reference:
tests/test_fused_decode.py compares the two.
"""

from __future__ import annotations

import itertools
import logging

import torch

from kvserve.attention.paged import AttentionMetadata
from kvserve.kernels.build import load_kernels
from kvserve.kv.storage import KVCacheStorage
from kvserve.models.fixed_order import fix_summation_order
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.quantized_linear import QuantizedLinear

logger = logging.getLogger(__name__)

# decode_layers' per-weight flag for each QuantPolicy path (any other: 0, the float32 kernel)
KERNEL_FLAGS = {
    "bf16 kernel": 1,
    "amx kernel": 2,
    "bf16 kernel, fixed order": 3,
    "bf16 kernel, interleaved": 4,
}


# decode_layers' weight slots per layer, in order
SLOT_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ABSENT = torch.empty(0, dtype=torch.uint8)  # an absent slot's tensor (its qtype is -1)


def _slots(layer: torch.nn.Module) -> tuple[torch.nn.Module | None, ...]:
    """A decoder layer's weights in decode_layers' slots: the fused qkv_proj (gate_up_proj)
    in the q (gate) slot with k, v (up) absent where the model fused them."""
    attn, mlp = layer.self_attn, layer.mlp
    if attn.qkv_proj is not None:
        qkv: tuple = (attn.qkv_proj, None, None)
    else:
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
    gate_up = getattr(mlp, "gate_up_proj", None)
    gu: tuple = (gate_up, None) if gate_up is not None else (mlp.gate_proj, mlp.up_proj)
    return (*qkv, attn.o_proj, *gu, mlp.down_proj)


class FusedDecode:
    """The arguments of ``kvserve::decode_layers`` for one model, gathered once."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        layers: list[tuple[QuantizedLinear | None, ...]],
        every_step: bool = False,
    ) -> None:
        cfg = model.config
        self.model = model
        self.num_heads = cfg.num_attention_heads
        self.intermediate = cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.attention_scale
        self.norms = [
            n.weight.detach().float().contiguous()
            for layer in model.model.layers
            for n in (layer.input_layernorm, layer.post_attention_layernorm)
        ]
        # 7 slots a layer (q, k, v, o, gate, up, down): a fused weight in its first member's
        # slot, the others absent (qtype -1)
        slots = [q for group in layers for q in group]
        self.qweights = [q.qweight if q is not None else _ABSENT for q in slots]
        self.qtypes = [q.qtype if q is not None else -1 for q in slots]
        self.slot_policies = [q.policy if q is not None else None for q in slots]
        self.policies = [p for p in self.slot_policies if p is not None]
        # a bfloat16 model's weights may take the bf16 kernel above the float32 one's rows
        self.bf16 = model.dtype == torch.bfloat16
        # batch-invariant mode (every weight in a fixed order): every step runs here, prefill
        # and mixed ones too, so a token's numbers are the same in any step (ARCHITECTURE.md
        # "Bitwise invariance"); else all-decode steps up to the kernels' row thresholds (a
        # fixed-order weight has none: any row count)
        self.every_step = every_step
        assert not every_step or (self.bf16 and all(p.fixed_order for p in self.policies))
        self.max_rows = min(
            1 << 62
            if p.fixed_order
            else p.interleaved_max_rows
            if p.interleaved
            else max(p.kernel_max_rows, p.bf16_kernel_max_rows if self.bf16 else 0)
            for p in self.policies
        )
        if self.every_step:
            self.max_rows = 1 << 62
        self.isa = layers[0][0].policy.isa
        # rows -> per weight: 0 the float32 kernel, 1 the bf16 kernel, 2 the bf16 one on AMX,
        # 3 the bf16 one in its fixed order, 4 the interleaved one (3 and 4: one set for every
        # row count)
        self._bf16_flags: dict[int, list[int]] = {}

    @classmethod
    def build(
        cls, model: LlamaForCausalLM, storage: KVCacheStorage, batch_invariant: bool = False
    ) -> FusedDecode | None:
        """The fused step for this model, or None (with the reason logged) when it can't run.
        ``batch_invariant``: first every quantized matmul in the fixed order, so that every
        step runs here; a ValueError says why where it cannot (checked before the model's
        policies change, so a refusal leaves the model as it was)."""
        if batch_invariant:
            why = cls._unsupported(model, storage)
            if why:
                raise ValueError(
                    f"batch_invariant is not available here: the fused step does not take this "
                    f"model and cache ({why}); it needs a quantized Llama-family model without "
                    "biases or q/k norm, full attention and a float KV cache"
                )
            why = fix_summation_order(model)
            if why:
                raise ValueError(f"batch_invariant is not available here: {why}")
        reason = cls._unsupported(model, storage)
        if reason:
            # a model with quantized weights expected the fused step: say why, once, where the
            # CLI shows it; a float model never takes it, which needs no warning
            quantized = any(isinstance(m, QuantizedLinear) for m in model.modules())
            level = logging.WARNING if quantized else logging.DEBUG
            logger.log(level, "fused decode step off (decode runs layer by layer): %s", reason)
            return None
        groups = [_slots(layer) for layer in model.model.layers]
        fused = cls(model, groups, every_step=batch_invariant)
        if fused.max_rows < 1:
            logger.debug("fused decode step off: the quantized kernel never wins here")
            return None
        if fused.every_step:
            logger.info("every step (prefill, decode, mixed): all layers in one kernel call "
                        "(kvserve::decode_layers), matmuls in the bf16 kernel's fixed order")  # fmt: skip
        else:
            logger.info(
                "decode steps of up to %d requests: all layers in one kernel call "
                "(kvserve::decode_layers)",
                fused.max_rows,
            )
        assert fused.every_step or not batch_invariant
        return fused

    @staticmethod
    def _unsupported(model: LlamaForCausalLM, storage: KVCacheStorage) -> str:
        cfg = model.config
        if not isinstance(model, LlamaForCausalLM):
            return f"{type(model).__name__} is not the Llama family"
        if model.device.type != "cpu" or storage.device.type != "cpu":
            return "not on CPU"
        if storage.kv is None:
            return f"the cache is not one float tensor ({storage.spec.describe()})"
        if storage.spec.has_windows:
            return f"windowed layers ({storage.spec.describe()}): the kernel attends everything"
        if not load_kernels():
            return "C++ kernels not loaded"
        if cfg.attention_bias or cfg.o_proj_bias or cfg.qk_norm:
            return "attention biases or q/k norm"
        if not storage.kv.is_contiguous():
            return "cache not contiguous"
        for i, layer in enumerate(model.model.layers):
            for name, m in zip(SLOT_NAMES, _slots(layer), strict=True):
                if m is None:
                    continue
                if not isinstance(m, QuantizedLinear):
                    return (
                        f"layer {i} {name} is held dense (GGUF Q5_1 and Q2_K weights are "
                        "dequantized at load, as are float ones)"
                    )
                if m.bias is not None:
                    return f"layer {i} {name} has a bias"
                if not m.policy.use_kernels:
                    return f"layer {i} {name} takes the reference path"
        return ""

    def fits(self, md: AttentionMetadata) -> bool:
        """True when this step can run fused: any step in the fixed order, else all decodes
        within the kernel's row range."""
        if self.every_step:
            return True
        return md.num_decodes == md.num_reqs and md.num_reqs <= self.max_rows and load_kernels()

    def __call__(
        self,
        input_ids: torch.Tensor,  # (T,) one per decode, a chunk per prefill (runner's order)
        positions: torch.Tensor,  # (T,)
        md: AttentionMetadata,
        storage: KVCacheStorage,
    ) -> torch.Tensor:
        """Final hidden states (B, hidden) in the model dtype, as ``model.forward`` returns."""
        inner = self.model.model
        rows = input_ids.shape[0]
        flags = self._bf16_flags.get(0 if self.every_step else rows)  # fixed order: one set
        if flags is None:  # the path each weight takes at this many rows (as quant_linear)
            flags = [
                0 if p is None else KERNEL_FLAGS.get(p.path(rows, self.bf16), 0)
                for p in self.slot_policies
            ]
            self._bf16_flags[0 if self.every_step else rows] = flags
        tables, seq_lens = md.block_tables, md.seq_lens_tensor
        if rows != md.num_reqs:
            # prefill tokens: each row is one query, over its request's blocks up to and
            # including its own position (its K/V are written before any row attends), so a
            # token's attention is the decode kernel's whatever the step: (T, width), (T,)
            counts = torch.tensor(
                [b - a for a, b in itertools.pairwise(md.query_start_loc)],
                dtype=torch.long,
            )
            req_of = torch.repeat_interleave(torch.arange(md.num_reqs), counts, output_size=rows)
            tables, seq_lens = tables[req_of], positions + 1
        x = inner.embed_tokens(input_ids).float()
        cos, sin = inner.rotary_emb(positions, torch.float32)  # (T, 1, head_dim)
        x = torch.ops.kvserve.decode_layers(
            x,
            cos.view(cos.shape[0], -1),
            sin.view(sin.shape[0], -1),
            storage.kv,
            md.slot_mapping,
            tables,
            seq_lens,
            self.norms,
            self.qweights,
            self.qtypes,
            flags,
            self.num_heads,
            self.intermediate,
            self.eps,
            self.scale,
            self.isa,
            self.every_step,  # batch-invariant mode: attention in one order for every step
        )
        return inner.norm(x.to(self.model.dtype))
