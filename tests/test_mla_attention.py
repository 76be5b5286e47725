"""Latent (MLA) attention and its cache, piece by piece: absorbed decode against expanded
attention on the same latent rows, the paged entry point against its per-request reference,
the latent storage's slots / copies / saved blocks, and bytes per token against the formula
(DeepSeek-V3, DeepSeek-V2-Lite and MiniCPM3 shapes, as the issue counts them)."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.mla import (
    MLAWeights,
    absorbed_decode,
    expanded_attention,
    paged_mla,
    reference_paged_mla,
)
from kvserve.attention.paged import AttentionMetadata
from kvserve.kv.cache_dtype import CacheDtype
from kvserve.kv.spec import KVCacheSpec, MLASpec
from kvserve.kv.storage import KVCacheStorage

HEADS, NOPE, ROPE, V, RANK = 4, 16, 8, 24, 32
F32 = CacheDtype("float32")


def weights(seed: int = 0) -> MLAWeights:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(HEADS, NOPE + V, RANK, generator=g) / RANK**0.5
    return MLAWeights(w[:, :NOPE], w[:, NOPE:])


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_absorbed_decode_equals_expanded_attention() -> None:
    w, scale = weights(), (NOPE + ROPE) ** -0.5
    rows = rand(37, RANK + ROPE, seed=1)  # one sequence's latent rows, the query's last
    q_nope, q_pe = rand(1, HEADS, NOPE, seed=2), rand(1, HEADS, ROPE, seed=3)
    want = expanded_attention(q_nope, q_pe, rows, w, scale)  # (1, heads, v)
    got = absorbed_decode(q_nope, q_pe, rows[None], None, w, scale)
    assert got.shape == want.shape == (1, HEADS, V)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def make_storage(num_blocks: int = 32, block_size: int = 4) -> KVCacheStorage:
    layer = MLASpec(RANK, ROPE, F32, block_size, HEADS, NOPE, V)
    return KVCacheStorage(KVCacheSpec.uniform(2, layer), num_blocks, "cpu", torch.float32)


def test_paged_mla_matches_the_expanded_reference() -> None:
    """3 decodes (absorbed) and 2 prefill chunks over cached prefixes, scattered blocks."""
    st, bs, w, scale = make_storage(), 4, weights(), 0.3
    seq_lens, new = [5, 9, 14, 11, 7], [1, 1, 1, 4, 7]
    tables = torch.tensor(
        [[3, 7, 0, 0], [1, 9, 12, 0], [4, 5, 6, 8], [10, 2, 11, 0], [13, 15, 0, 0]]
    )
    # rows of the tokens cached before this step, at their slots
    g = torch.Generator().manual_seed(5)
    for i, (n, t) in enumerate(zip(seq_lens, new, strict=True)):
        pos = torch.arange(n - t)
        slots = tables[i, pos // bs] * bs + pos % bs
        st.write_latent(0, slots, torch.randn(n - t, RANK + ROPE, generator=g))
    starts = [0]
    for t in new:
        starts.append(starts[-1] + t)
    slot_mapping = torch.cat(
        [tables[i, p // bs] * bs + p % bs for i, p in
         enumerate(torch.arange(n - t, n) for n, t in zip(seq_lens, new, strict=True))]
    )  # fmt: skip
    md = AttentionMetadata(slot_mapping, starts, seq_lens, tables, 3, torch.tensor(seq_lens))
    total = starts[-1]
    q_nope, q_pe = rand(total, HEADS, NOPE, seed=6), rand(total, HEADS, ROPE, seed=7)
    latent = rand(total, RANK + ROPE, seed=8)
    got = paged_mla(st, md, 0, q_nope, q_pe, latent, w, scale)
    want = reference_paged_mla(st, md, 0, q_nope, q_pe, w, scale)
    assert got.shape == (total, HEADS, V)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # this step's rows landed at their slots, layer 1 untouched
    flat = st.groups[0].latent[0].view(-1, RANK + ROPE)
    assert torch.equal(flat[slot_mapping], latent)
    assert not st.groups[0].latent[1].any()


def test_latent_blocks_copy_save_and_restore() -> None:
    st = make_storage(num_blocks=6)
    rows = rand(6 * 4, RANK + ROPE, seed=9)
    for layer in (0, 1):
        st.write_latent(layer, torch.arange(24), rows + layer)
    st.copy_blocks([2], [5])  # copy-on-write of a shared block
    torch.testing.assert_close(st.read_latent_block(1, 5, 4), rows[8:12] + 1)
    saved = st.read_blocks([1, 5])
    assert list(saved) == ["latent"] and saved["latent"].shape == (2, 2, 4, RANK + ROPE)
    other = make_storage(num_blocks=6)
    other.write_blocks([0, 3], saved)
    assert torch.equal(
        other.gather_latent(0, torch.tensor([[0, 3]]))[0],
        st.gather_latent(0, torch.tensor([[1, 5]]))[0],
    )
    assert st.nbytes == 2 * 6 * 4 * (RANK + ROPE) * 4


@pytest.mark.parametrize(
    ("rank", "rope", "heads", "nope", "v", "latent", "mha"),
    [
        (512, 64, 128, 128, 128, 576, 40960),  # DeepSeek-V3 / V2
        (512, 64, 16, 128, 128, 576, 5120),  # DeepSeek-V2-Lite
        (256, 32, 40, 64, 64, 288, 6400),  # MiniCPM3-4B
    ],
)
def test_bytes_per_token_is_the_formula(rank, rope, heads, nope, v, latent, mha) -> None:
    spec = MLASpec(rank, rope, CacheDtype("bfloat16"), 16, heads, nope, v)
    assert spec.width == latent
    assert spec.bytes_per_token == latent * 2
    assert spec.bytes_per_block == latent * 2 * 16
    assert spec.mha_equivalent_bytes_per_token == mha * 2
    assert (spec.max_blocks(16), spec.max_blocks(17), spec.first_needed_block(100)) == (1, 2, 0)
    assert spec.describe() == (
        f"mla (latent {rank} + rope {rope}, bfloat16; {latent * 2:,} B/token/layer vs "
        f"{mha * 2:,} as MHA)"
    )


def test_only_an_fp8_latent_with_a_float_rope_is_accepted() -> None:
    with pytest.raises(ValueError, match="latent cache cannot be int8"):
        MLASpec(RANK, ROPE, CacheDtype("int8"))
    with pytest.raises(ValueError, match="needs a float rope_dtype"):
        MLASpec(RANK, ROPE, CacheDtype("fp8_e4m3"))
    # DeepSeek-V3: 512 fp8 codes + a float16 scale + 64 bfloat16 rope values
    v3 = MLASpec(512, 64, CacheDtype("fp8_e4m3"), 16, 128, 128, 128, CacheDtype("bfloat16"))
    assert v3.bytes_per_token == 512 + 2 + 128 == 642


def test_fp8_latent_rows_round_trip_through_the_reference_quantizer() -> None:
    fp8, f32 = CacheDtype("fp8_e4m3"), torch.float32
    layer = MLASpec(RANK, ROPE, fp8, 4, HEADS, NOPE, V, CacheDtype("float32"))
    st = KVCacheStorage(KVCacheSpec.uniform(1, layer), 8, "cpu", f32)
    rows = rand(10, RANK + ROPE, seed=11)
    slots = torch.tensor([4, 5, 6, 7, 20, 21, 22, 23, 8, 9])  # blocks 1, 5, 2
    st.write_latent(0, slots, rows)
    codes, scales, _ = fp8.quantize(rows[:, :RANK])
    want = torch.cat((fp8.dequantize(codes, scales, None, RANK, f32), rows[:, RANK:]), -1)
    got = st.gather_latent(0, torch.tensor([[1, 5, 2]]))[0, :10]
    assert torch.equal(got, want)  # the rope key exact, the latent as the reference rounds it
    assert torch.equal(st.read_latent_block(0, 2, 2), want[8:])
    assert not torch.equal(want, rows)
    assert st.nbytes == 8 * 4 * layer.bytes_per_token == 8 * 4 * (RANK + 2 + ROPE * 4)
    assert sorted(st.read_blocks([1])) == ["latent.codes", "latent.rope", "latent.scales"]
