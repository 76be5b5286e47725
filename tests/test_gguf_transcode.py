"""Q3_K and Q5_0 weights held losslessly as Q6_K and Q8_0 (models/gguf_transcode.py): the
same float32 values bit for bit as gguf-py's dequantizer gives for the file's bytes, whatever
the codes and scales; and a Q3_K_M-style file (Q3_K, with Q5_K attn_v / ffn_down and a Q5_0
weight) loads with no dense layer and decodes on the fused step with the reference tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import random_token_ids
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize
from test_fused_decode import pin_kernel_rows
from test_gguf_quants import random_blocks
from test_kquant_fused import interleaves_by_default, mixed_gguf
from test_quant_kernels import kernels  # noqa: F401 - the fixture

from kvserve.engine.llm import LLM
from kvserve.models.gguf_transcode import TRANSCODED, transcode
from kvserve.models.model_session import ModelSession
from kvserve.models.quantized_linear import QuantizedLinear
from kvserve.sampling import SamplingParams

# float16 scale bytes: the largest finite, the smallest subnormal, zero, either sign
EXTREME_D = [65504.0, -65504.0, 6e-8, -6e-8, 0.0, 1.0, -0.5]
D_OFFSET = {GT.Q3_K: 108, GT.Q5_0: 0}


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("src", sorted(TRANSCODED), ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_transcoding_keeps_every_value_bit_for_bit(src: GT, seed: int) -> None:
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[src]
    rows = random_blocks(9, 5 * block, src, rng)  # 9 rows of 5 blocks, random codes
    blocks = rows.reshape(-1, size)
    # extreme scales in some blocks: products stay exact, infinities stay infinities
    pick = rng.choice(len(blocks), size=len(EXTREME_D), replace=False)
    d = np.array(EXTREME_D, np.float16).view(np.uint8).reshape(-1, 2)
    blocks[pick, D_OFFSET[src] : D_OFFSET[src] + 2] = d
    held, qtype = transcode(rows, src)
    assert qtype == int(TRANSCODED[src])
    target_block, target_size = GGML_QUANT_SIZES[GT(qtype)]
    assert held.dtype == np.uint8 and held.shape == (9, 5 * block // target_block * target_size)
    want, got = dequantize(rows, src), dequantize(held, GT(qtype))
    assert np.array_equal(_bits(want), _bits(got))


def test_every_code_and_scale_survives() -> None:
    """All 8 Q3_K codes at each of the 64 scales, all 32 Q5_0 codes: exhaustive, not random."""
    q3 = np.zeros((64, 110), np.uint8)
    q3[:, 108:110] = np.array([1.0], np.float16).view(np.uint8)
    for s in range(64):  # every 6-bit scale in sub-block s % 16
        lo, hi = s & 15, s >> 4
        j = s % 16
        q3[s, 96 + j % 8] |= lo << (4 * (j // 8))
        q3[s, 104 + j % 4] |= hi << (2 * (j // 4))
    q3[:, :96] = np.random.default_rng(0).integers(0, 256, (64, 96), dtype=np.uint8)
    q5 = np.random.default_rng(1).integers(0, 256, (64, 22), dtype=np.uint8)
    q5[:, :2] = np.array([0.25], np.float16).view(np.uint8)
    for rows, src in ((q3, GT.Q3_K), (q5, GT.Q5_0)):
        held, qtype = transcode(rows, src)
        want = dequantize(rows, src)
        assert np.array_equal(_bits(want), _bits(dequantize(held, GT(qtype))))
    assert len(np.unique(dequantize(q5, GT.Q5_0) * 4)) == 32  # every 5-bit code was seen


def test_bad_input_names_what_was_wrong() -> None:
    with pytest.raises(ValueError, match="110-byte blocks"):
        transcode(np.zeros((2, 111), np.uint8), GT.Q3_K)
    with pytest.raises(ValueError, match="no lossless transcoding for Q2_K"):
        transcode(np.zeros((2, 84), np.uint8), GT.Q2_K)
    with pytest.raises(ValueError, match="2-D uint8"):
        transcode(np.zeros(22, np.uint8), GT.Q5_0)


def _q3_k_m_gguf(tmp_path: Path) -> Path:
    """Q3_K linears; layer 0's attn_v and ffn_down Q5_K (as llama.cpp's Q3_K_M does), layer
    1's ffn_up Q5_0."""

    def pick(i: int, part: str) -> GT:
        if i == 0 and part in ("attn_v", "ffn_down"):
            return GT.Q5_K
        return GT.Q5_0 if i == 1 and part == "ffn_up" else GT.Q3_K

    return mixed_gguf(tmp_path / "q3_k_m.gguf", pick, seed=5)


@pytest.mark.usefixtures("kernels")
def test_a_q3_k_m_file_decodes_fused_with_the_reference_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _q3_k_m_gguf(tmp_path)
    session = ModelSession.open(path, "float32", "cpu")
    linears = [m for m in session.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) >= 10  # nothing held dense
    held = {int(m.qtype) for m in linears}
    assert held == {int(GT.Q6_K), int(GT.Q5_K), int(GT.Q8_0)}, held
    pin_kernel_rows(session.model)  # a noisy timing on tiny weights must not turn it off
    llm = LLM(session=session, num_kv_blocks=64, block_size=4, enforce_eager=True)
    assert llm.engine.fused_decode is not None, "a Q3_K_M file must take the fused step"
    prompts = [random_token_ids(n, seed=n) for n in (5, 11)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("KVSERVE_KERNELS", "0")  # the reference: PyTorch dequantize + matmul
    ref = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=4, enforce_eager=True)
    want = [o.token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    assert got == want


@interleaves_by_default
def test_the_default_bfloat16_path_interleaves_a_q3_k_m_file(tmp_path: Path) -> None:
    """Every weight interleaved, the fused step on; the numbers checked against float32 by
    teacher forcing (bfloat16 may break a near-tie of random weights the other way, so the
    tokens are not compared): the float32 model scores the bfloat16 run's tokens as a prompt,
    and each token's logprob agrees within bfloat16's error."""
    path = _q3_k_m_gguf(tmp_path)
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=64)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert linears and all(m.policy.interleaved for m in linears)
    assert llm.engine.fused_decode is not None
    prompt = random_token_ids(24, seed=4)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    (got,) = llm.generate([prompt], params, use_tqdm=False)
    ref = LLM(str(path), dtype="float32", num_kv_blocks=64, enforce_eager=True)
    scored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (want,) = ref.generate([prompt + got.token_ids], scored, use_tqdm=False)
    for i, tok in enumerate(got.token_ids):
        bf16 = got.logprobs[i][tok]
        f32 = want.prompt_logprobs[len(prompt) + i][tok]
        assert abs(bf16 - f32) < 0.15, (i, tok, bf16, f32)
