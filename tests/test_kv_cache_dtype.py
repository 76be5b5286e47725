"""Quantized K/V storage: round-trip error bounds per format, exact bytes per spec, and the
storage protocol (write, gather, copy-on-write, saved blocks) on quantized blocks."""

from __future__ import annotations

import pytest
import torch

from kvserve.kv.cache_dtype import QUANTIZED, CacheDtype
from kvserve.kv.spec import FullAttentionSpec, KVCacheSpec
from kvserve.kv.storage import KVCacheStorage

D = 64


def outlier_tensor(shape=(40, 3, D), seed=0) -> torch.Tensor:
    """Gaussian K-like rows with a few outlier channels (x20), as real keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[..., [3, 17, 40]] *= 20.0
    x[..., 50] += 8.0  # a channel with a large mean: what asymmetric int4_sym is for
    return x


def group_bound(x: torch.Tensor, name: str) -> torch.Tensor:
    """The worst error each value may have: half a quantization step of its group (a whole
    step for the clamped end of symmetric int4_sym), plus the float16 rounding of the scale."""
    g = CacheDtype(name).group_size(x.shape[-1])
    xg = x.reshape(*x.shape[:-1], -1, g)
    amax = xg.abs().amax(-1, keepdim=True)
    if name == "int8":
        step = amax / 127
        bound = step * 0.5 + amax * 2**-10
    elif name == "int4_sym":
        step = amax / 8
        bound = step + amax * 2**-10
    elif name == "int4":
        step = (xg.amax(-1, keepdim=True) - xg.amin(-1, keepdim=True)) / 15
        bound = step * 0.5 + amax * 2**-9
    else:  # fp8 e4m3: 3 mantissa bits, relative 2^-4, subnormals below 2^-6 of the scale
        scale = amax / 448
        bound = xg.abs() * 2**-4 + scale * 2**-9 + amax * 2**-10
    return bound.expand_as(xg).reshape(x.shape) * 1.0001 + 1e-7


@pytest.mark.parametrize("name", QUANTIZED)
def test_round_trip_within_the_format_bound(name: str) -> None:
    x = outlier_tensor()
    dt = CacheDtype(name)
    codes, scales, mins = dt.quantize(x)
    assert codes.dtype == dt.code_dtype and codes.shape[-1] == dt.code_bytes(D)
    assert scales.dtype == torch.float16 and scales.shape[-1] == dt.num_groups(D)
    assert (mins is not None) == (name == "int4")
    y = dt.dequantize(codes, scales, mins, D)
    err = (y - x).abs()
    assert bool((err <= group_bound(x, name)).all()), float((err - group_bound(x, name)).max())
    assert float(err.max()) > 0  # lossy: a test that cannot fail would pass a no-op


def test_more_bits_less_error_and_zero_groups_stay_zero() -> None:
    x = outlier_tensor(seed=1)
    errs = {}
    for name in QUANTIZED:
        dt = CacheDtype(name)
        errs[name] = float((dt.dequantize(*dt.quantize(x), D) - x).norm() / x.norm())
    assert errs["int8"] < errs["int4"] < errs["int4_sym"]
    assert errs["fp8_e4m3"] < errs["int4"]
    for name in QUANTIZED:
        dt = CacheDtype(name)
        z = torch.zeros(2, 3, D)
        assert torch.equal(dt.dequantize(*dt.quantize(z), D), z)


def test_bytes_per_head_by_hand() -> None:
    # codes + float16 scales (+ mins), per token and KV head, head_dim 64 and 80 (80 % 32 != 0:
    # one group per head)
    assert CacheDtype("bfloat16").bytes_per_head(64) == 128
    assert CacheDtype("float32").bytes_per_head(64) == 256
    assert CacheDtype("int8").bytes_per_head(64) == 64 + 2 * 2
    assert CacheDtype("int4_sym").bytes_per_head(64) == 32 + 2 * 2
    assert CacheDtype("int4").bytes_per_head(64) == 32 + 2 * 2 * 2
    assert CacheDtype("fp8_e4m3").bytes_per_head(64) == 64 + 2
    assert CacheDtype("int8").bytes_per_head(80) == 80 + 2
    assert CacheDtype("int4_sym").bytes_per_head(128) == 64 + 4 * 2


def test_spec_bytes_by_hand_and_storage_allocates_exactly_that() -> None:
    # the default model's shape: 30 layers x 3 KV heads x 64; K int4_sym, V int8, blocks of 16
    spec = KVCacheSpec.full_attention(30, 3, 64, "int4_sym", 16, v_dtype="int8")
    assert spec.bytes_per_token == 30 * 3 * ((32 + 4) + (64 + 4))
    assert spec.bytes_per_block == 16 * spec.bytes_per_token
    bf16 = KVCacheSpec.full_attention(30, 3, 64, torch.bfloat16)
    assert bf16.bytes_per_token == 2 * 30 * 3 * 64 * 2
    memory = 1 << 24
    for s in (spec, bf16):
        n = s.num_blocks_for(memory)
        storage = KVCacheStorage(s, n)
        assert storage.nbytes == n * s.bytes_per_block <= memory
        assert (n + 1) * s.bytes_per_block > memory
    # at the same memory int8 holds 128 / 68 = 1.88x the tokens of bfloat16, int4_sym 128 / 36
    i8 = KVCacheSpec.full_attention(30, 3, 64, "int8")
    i4 = KVCacheSpec.full_attention(30, 3, 64, "int4_sym")
    assert bf16.bytes_per_token / i8.bytes_per_token == pytest.approx(128 / 68)
    assert bf16.bytes_per_token / i4.bytes_per_token == pytest.approx(128 / 36)
    assert spec.describe() == "30 x full_attention (3 kv heads x 64, K int4_sym, V int8)"


def test_bad_dtypes_and_shapes_raise() -> None:
    with pytest.raises(ValueError, match="cache dtype must be one of"):
        CacheDtype("int3")
    with pytest.raises(ValueError, match="even head_dim"):
        FullAttentionSpec(2, 7, CacheDtype("int4_sym"), CacheDtype("int4_sym"))
    with pytest.raises(ValueError, match="one block size"):
        KVCacheSpec(
            (
                FullAttentionSpec(2, 8, CacheDtype("int8"), CacheDtype("int8"), 16),
                FullAttentionSpec(2, 8, CacheDtype("int8"), CacheDtype("int8"), 8),
            )
        )


def quantized_storage(k: str, v: str, num_blocks: int = 6, layers: int = 2) -> KVCacheStorage:
    spec = KVCacheSpec.full_attention(layers, 3, D, k, 4, v_dtype=v)
    return KVCacheStorage(spec, num_blocks, compute_dtype=torch.float32)


@pytest.mark.parametrize("k,v", [("int8", "int8"), ("int4_sym", "fp8_e4m3"), ("int4", "bfloat16")])
def test_write_gather_copy_and_saved_blocks(k: str, v: str) -> None:
    st = quantized_storage(k, v)
    assert st.kv is None and st.is_quantized
    x_k, x_v = outlier_tensor((8, 3, D), 2), outlier_tensor((8, 3, D), 3)
    slots = torch.tensor([20, 21, 22, 23, 4, 5, 6, 7])  # block 5, then block 1
    st.write(1, slots, x_k, x_v)
    gk, gv = st.gather(1, torch.tensor([[5, 1]]))  # (1, 8, 3, D)
    want_k = CacheDtype(k).dequantize(*CacheDtype(k).quantize(x_k), D)
    want_v = CacheDtype(v).dequantize(*CacheDtype(v).quantize(x_v), D)
    assert torch.equal(gk[0], want_k) and torch.equal(gv[0], want_v)
    zk, _ = st.gather(0, torch.tensor([[5, 1]]))  # layer 0 untouched: zeros, no NaN
    assert torch.equal(zk, torch.zeros_like(zk))

    st.copy_blocks([5], [2])  # copy-on-write copies codes and scales alike
    ck, cv = st.gather(1, torch.tensor([[2]]))
    assert torch.equal(ck, gk[:, :4]) and torch.equal(cv, gv[:, :4])

    saved = st.read_blocks([5, 1])
    assert all(t.shape[0] == 2 for t in saved.values())
    other = quantized_storage(k, v)
    other.write_blocks([0, 3], saved)
    ok, ov = other.gather(1, torch.tensor([[0, 3]]))
    assert torch.equal(ok, gk) and torch.equal(ov, gv)
    with pytest.raises(ValueError, match="saved blocks hold"):  # a float cache's layout
        quantized_storage("bfloat16", "bfloat16").write_blocks([0, 3], saved)
    wrong = quantized_storage(k, v, layers=3)  # same names, another shape
    with pytest.raises(ValueError, match="does not fit"):
        wrong.write_blocks([0, 3], saved)
