"""`--quantization q8_0|q4_0`: a Hugging Face checkpoint's float weights quantized at load, and
`kvserve info`: what the machine is and what kvserve picks on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import hf_logits, make_hf_checkpoint, random_token_ids, run_cli
from gguf import GGMLQuantizationType as QT

from kvserve.kernels.quant_ref import dequantize_ref, quantize
from kvserve.models.loader import load_model
from kvserve.models.packed_linear import dense_state_dict
from kvserve.platform import detect_cpu_features
from kvserve.reference.decoders import full_logits


@pytest.mark.parametrize("quantization,qtype", [("q8_0", QT.Q8_0), ("q4_0", QT.Q4_0)])
@pytest.mark.parametrize("tied", [False, True])
def test_quantized_at_load_equals_transformers_on_the_rounded_weights(
    tmp_path: Path, quantization: str, qtype: QT, tied: bool
) -> None:
    ckpt, hf = make_hf_checkpoint(
        tmp_path, "llama", num_key_value_heads=2, tie_word_embeddings=tied
    )
    loaded = load_model(ckpt, "float32", "cpu", quantization=quantization)
    # 2 layers x (q, k, v, o, gate, up, down), the embedding, and the lm_head unless it is the
    # embedding (tied: one tensor, multiplied and looked up from the same bytes)
    linears = 2 * 7 + (1 if tied else 2)
    assert loaded.weights.tensors_by_format == {qtype.name: linears}
    # the reference: transformers with every matrix replaced by dequantize(quantize(W))
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 2:
                q = quantize(p.detach(), qtype)
                p.copy_(dequantize_ref(q, qtype, p.shape[0], p.shape[1]))
    ids = random_token_ids(24)
    got = full_logits(loaded.model, ids)
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=2e-4, rtol=0)


def test_unknown_quantization_is_refused(tmp_path: Path) -> None:
    ckpt, _ = make_hf_checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError, match="quantization must be one of q8_0, q4_0, got 'q3'"):
        load_model(ckpt, quantization="q3")


@pytest.mark.parametrize("cap", [None, "avx2", "none"])
def test_info_reports_features_and_auto_dtype(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, cap: str | None
) -> None:
    if cap is None:  # the uncapped report, even when the suite itself runs under a cap
        monkeypatch.delenv("KVSERVE_CPU_FEATURES", raising=False)
    else:
        monkeypatch.setenv("KVSERVE_CPU_FEATURES", cap)
    features = detect_cpu_features()
    code, out, _ = run_cli(capsys, "info", "--no-model", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["torch_version"] == torch.__version__
    assert report["cpu_features"] == features.names()
    assert report["cpu_features_capped_to"] == cap
    assert report["threads"] == torch.get_num_threads()
    assert report["auto_dtype"] == ("bfloat16" if features.native_bf16 else "float32")
    if cap is not None:
        assert not features.native_bf16 and report["auto_dtype"] == "float32"
    want_isa = {None: None, "avx2": "avx2+fma", "none": "scalar"}[cap]
    if report["kernels_loaded"] and want_isa is not None:
        assert report["kernel_isa"] == want_isa
    assert report["memory_bandwidth_gb_s"] > 0


def test_fused_rows_are_views_and_export_keeps_hf_names(tmp_path: Path) -> None:
    ckpt, hf = make_hf_checkpoint(tmp_path, "llama", num_key_value_heads=2)
    loaded = load_model(ckpt, "float32", "cpu", quantization="q8_0")
    attn = loaded.model.model.layers[0].self_attn
    fused = attn.qkv_proj.qweight
    # q/k/v keep their HF modules, as views of the fused rows: no byte held twice
    for part in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert part.qweight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert attn.q_proj.qweight.data_ptr() == fused.data_ptr()
    assert loaded.model.model.layers[0].mlp.gate_up_proj is not None
    state = dense_state_dict(loaded.model)
    assert set(state) == set(hf.state_dict())
    for name, want in hf.state_dict().items():
        assert state[name].shape == want.shape, name
