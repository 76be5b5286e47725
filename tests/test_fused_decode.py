"""The fused decode step (kvserve::decode_layers) against the eager layers it replaces: the
same hidden states and the same K/V written, for a batch of decodes over multi-block contexts,
on every ISA path the CPU has; when it runs and when it does not; the errors it raises."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import make_hf_checkpoint, random_token_ids
from test_quant_kernels import kernels  # noqa: F401 - the fixture: the extension, built

from kvserve.attention.paged import AttentionMetadata, PagedAttention
from kvserve.engine.fused_decode import FusedDecode
from kvserve.engine.llm import LLM
from kvserve.kv.storage import KVCacheStorage
from kvserve.models.loader import load_model
from kvserve.models.model_session import ModelSession
from kvserve.models.quantized_linear import QuantizedLinear
from kvserve.sampling import SamplingParams

BLOCK = 4


pytestmark = pytest.mark.usefixtures("kernels")


def load(tmp_path: Path, dtype: str = "float32", quantization: str = "q8_0", **overrides):
    path, _ = make_hf_checkpoint(
        tmp_path,
        overrides.pop("model_type", "llama"),
        num_key_value_heads=2,
        max_position_embeddings=512,
        **overrides,
    )
    return pin_kernel_rows(load_model(path, dtype, "cpu", quantization=quantization).model)


def pin_kernel_rows(model, rows: int = 64):
    """Every quantized layer on the float32 kernel up to ``rows`` rows, whatever the load-time
    timing measured (on tiny weights a noisy timing can put the threshold below a test's
    batch, and the step would then -- correctly -- not run fused)."""
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            m.policy = replace(
                m.policy, kernel_max_rows=rows, bf16_kernel_max_rows=0, amx_min_rows=0
            )
    return model


def metadata(tables: list[list[int]], starts: list[int], lens: list[int], slots: list[int]):
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=starts,
        seq_lens=lens,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        num_decodes=sum(1 for a, b in zip(starts, starts[1:], strict=False) if b - a == 1),
        seq_lens_tensor=torch.tensor(lens),
    )


def prefilled(model, prompt_lens: list[int]):
    """A cache holding each prompt (written by the eager layers), and one decode step's
    inputs: a new token per request at position len(prompt)."""
    spec = model.kv_cache_spec(block_size=BLOCK)
    storage = KVCacheStorage(spec, 64)
    tables, next_block = [], 1  # block 0 stays unused: padding reads it
    for n in prompt_lens:
        nb = -(-(n + 1) // BLOCK)
        tables.append(list(range(next_block, next_block + nb)))
        next_block += nb
    with torch.inference_mode():
        for i, n in enumerate(prompt_lens):
            slots = [tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
            md = metadata([tables[i]], [0, n], [n], slots)
            ids = torch.tensor(random_token_ids(n, seed=i))
            model(ids, torch.arange(n), PagedAttention(storage, md, model.config.attention_scale))
    b = len(prompt_lens)
    slots = [tables[i][n // BLOCK] * BLOCK + n % BLOCK for i, n in enumerate(prompt_lens)]
    md = metadata(tables, list(range(b + 1)), [n + 1 for n in prompt_lens], slots)
    ids = torch.tensor([random_token_ids(1, seed=100 + i)[0] for i in range(b)])
    return storage, md, ids, torch.tensor(prompt_lens)


def both_ways(model, storage, md, ids, positions, isa: int | None = None):
    """(eager hidden, eager kv), (fused hidden, fused kv) from the same starting cache."""
    before = storage.kv.clone()
    with torch.inference_mode():
        eager = model(ids, positions, PagedAttention(storage, md, model.config.attention_scale))
        eager_kv = storage.kv.clone()
        storage.kv.copy_(before)
        fused = FusedDecode.build(model, storage)
        assert fused is not None and fused.fits(md)
        if isa is not None:
            fused.isa = isa
        got = fused(ids, positions, md, storage)
    return (eager, eager_kv), (got, storage.kv.clone())


@pytest.mark.parametrize(
    "quantization,prompt_lens",
    [
        ("q8_0", [3, 9, 17]),  # 1, 3 and 5 blocks; partial ones
        ("q4_0", [3, 9, 17]),
        ("q4_0", [1 + i % 7 for i in range(20)]),  # 20 rows: the norms split over threads
    ],
    ids=["q8_0", "q4_0", "q4_0-20-rows"],
)
def test_float32_equals_eager_layers(tmp_path: Path, quantization: str, prompt_lens) -> None:
    model = load(tmp_path, quantization=quantization)
    storage, md, ids, pos = prefilled(model, prompt_lens)
    before = storage.kv.clone()
    (eager, eager_kv), (got, got_kv) = both_ways(model, storage, md, ids, pos)
    # the same kernels and arithmetic; only reduction orders (norm, softmax) differ
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_kv, eager_kv, rtol=1e-5, atol=1e-5)
    # the decode tokens' K/V landed at their slots, and nothing else moved
    flat = (2, model.config.num_hidden_layers, -1, 2, model.config.head_dim)
    moved = (got_kv != before).view(flat).flatten(3).any(-1).any(0).any(0)  # (slots,)
    assert moved.nonzero().flatten().tolist() == sorted(md.slot_mapping.tolist())
    logits_eager = model.compute_logits(eager)
    logits_fused = model.compute_logits(got)
    assert torch.equal(logits_eager.argmax(-1), logits_fused.argmax(-1))


def test_every_isa_path_agrees(tmp_path: Path) -> None:
    best = int(torch.ops.kvserve.cpu_isa())
    model = load(tmp_path)
    storage, md, ids, pos = prefilled(model, [5, 12])
    outs = []
    for isa in range(best + 1):  # scalar, AVX2, AVX-512: each the CPU has
        (eager, _), (got, _) = both_ways(model, storage, md, ids, pos, isa=isa)
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
        outs.append(got)
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("intermediate", [1, 7, 16, 37, 1536])
def test_silu_mul_matches_torch_on_every_isa(intermediate: int) -> None:
    """kvserve::silu_mul (the fused step's MLP activation) against F.silu(g) * u, on every ISA
    path the CPU has: row tails (sizes not multiples of 8 / 16), and gates far out on both
    sides, where exp(-g) overflows (g -> -inf gives -0) or underflows (g -> +inf gives g)."""
    g = torch.Generator().manual_seed(intermediate)
    gu = torch.randn(5, 2 * intermediate, generator=g) * 4
    gu[0, :intermediate] = torch.linspace(-120, 120, intermediate)
    gu[1, : min(4, intermediate)] = torch.tensor([-1e30, 1e30, 0.0, -0.0])[: min(4, intermediate)]
    want = torch.nn.functional.silu(gu[:, :intermediate]) * gu[:, intermediate:]
    for isa in range(int(torch.ops.kvserve.cpu_isa()) + 1):  # scalar, AVX2, AVX-512
        got = torch.ops.kvserve.silu_mul(gu, isa)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30, msg=f"isa {isa}")
    with pytest.raises(RuntimeError, match="isa 7"):
        torch.ops.kvserve.silu_mul(gu, 7)
    with pytest.raises(RuntimeError, match="rows, 2 \\* intermediate"):
        torch.ops.kvserve.silu_mul(gu[:, :-1] if intermediate > 0 else gu, -1)


def test_bfloat16_model_close_to_eager(tmp_path: Path) -> None:
    model = load(tmp_path, dtype="bfloat16")
    storage, md, ids, pos = prefilled(model, [6, 11])
    (eager, eager_kv), (got, got_kv) = both_ways(model, storage, md, ids, pos)
    assert got.dtype == eager.dtype == torch.bfloat16
    # eager rounds every activation to bfloat16, the fused step keeps them float32: bf16-level
    # agreement, not bit equality
    torch.testing.assert_close(got.float(), eager.float(), rtol=0.05, atol=0.05)
    torch.testing.assert_close(got_kv.float(), eager_kv.float(), rtol=0.05, atol=0.05)


def test_runs_only_where_it_can(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dense = load(tmp_path / "dense", quantization=None)
    spec = dense.kv_cache_spec(block_size=BLOCK)
    assert FusedDecode.build(dense, KVCacheStorage(spec, 8)) is None  # float weights
    qk_norm = load(tmp_path / "qwen3", model_type="qwen3", head_dim=16)
    spec = qk_norm.kv_cache_spec(block_size=BLOCK)
    assert FusedDecode.build(qk_norm, KVCacheStorage(spec, 8)) is None  # q/k norm
    model = load(tmp_path / "q8")
    storage, md, ids, pos = prefilled(model, [3, 4])
    fused = FusedDecode.build(model, storage)
    assert fused is not None and fused.fits(md)
    prefill = metadata([[1, 2]], [0, 3], [3], [4, 5, 6])  # a prefill chunk: not fused
    assert not fused.fits(prefill)
    monkeypatch.setenv("KVSERVE_KERNELS", "0")
    assert not fused.fits(md)  # the kernels turned off after load: the eager layers run


def test_bad_inputs_raise_naming_the_value(tmp_path: Path) -> None:
    model = load(tmp_path)
    storage, md, ids, pos = prefilled(model, [3])
    fused = FusedDecode.build(model, storage)
    md.slot_mapping = torch.tensor([64 * BLOCK])
    with pytest.raises(RuntimeError, match=r"slot_mapping\[0\] = 256 is not a slot in \[0, 256\)"):
        fused(ids, pos, md, storage)
    md.slot_mapping = torch.tensor([7])
    md.seq_lens_tensor = torch.tensor([99])
    with pytest.raises(RuntimeError, match=r"seq_lens\[0\] = 99 must be in \[1, 4\]"):
        fused(ids, pos, md, storage)
    fused.qtypes = fused.qtypes[:-1]
    with pytest.raises(RuntimeError, match="2 layers need 4 norms and 14 weight slots"):
        fused(ids, pos, md, storage)
    fused.qtypes = [-1] + fused.qtypes[1:] + [fused.qtypes[-1]]  # the q slot absent
    with pytest.raises(RuntimeError, match="layer 0: only k and v .* may be absent"):
        fused(ids, pos, md, storage)


def test_engine_tokens_equal_with_the_kernels_turned_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback of the fused step: with KVSERVE_KERNELS=0 after load, decode steps run
    layer by layer (eager here) with the gathered-SDPA attention, and must give the fused
    step's greedy tokens (float32)."""
    path, _ = make_hf_checkpoint(tmp_path, "llama", num_key_value_heads=2)
    session = ModelSession.open(path, "float32", "cpu", quantization="q8_0")
    pin_kernel_rows(session.model)
    prompts = [random_token_ids(n, seed=n) for n in (5, 9, 14)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(session=session, num_kv_blocks=64, block_size=BLOCK, enforce_eager=True)
    assert llm.engine.fused_decode is not None
    fused = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("KVSERVE_KERNELS", "0")
    assert not llm.engine.fused_decode.fits(metadata([[1]], [0, 1], [1], [4]))
    fallback = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert fallback == fused
