"""What a replica tells routers its architecture is (/model_info, /server_info): the
checkpoint's own config.json ``architectures``, else transformers' class name for its
model_type; every family kvserve loads has one (MiniCPM3 was reported as LlamaForCausalLM)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from kvserve.models.architectures import HF_ARCHITECTURES, hf_architectures
from kvserve.models.deepseek import DEEPSEEK_REGISTRY
from kvserve.models.llama import MODEL_REGISTRY


def test_every_family_kvserve_loads_has_a_name() -> None:
    assert HF_ARCHITECTURES.keys() == MODEL_REGISTRY.keys() | DEEPSEEK_REGISTRY.keys()


@pytest.mark.parametrize(
    ("model_type", "name"),
    [
        ("llama", "LlamaForCausalLM"),
        ("smollm", "LlamaForCausalLM"),
        ("mistral", "MistralForCausalLM"),
        ("qwen2", "Qwen2ForCausalLM"),
        ("qwen3", "Qwen3ForCausalLM"),
        ("deepseek_v2", "DeepseekV2ForCausalLM"),
        ("deepseek_v3", "DeepseekV3ForCausalLM"),
        ("minicpm3", "MiniCPM3ForCausalLM"),
    ],
)
def test_a_gguf_file_gets_the_table_name(tmp_path: Path, model_type: str, name: str) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert hf_architectures(model_type, gguf) == (name,)


def test_the_names_are_transformers_class_names() -> None:
    # MiniCPM3 ships its modeling code with the checkpoint (trust_remote_code), not in
    # transformers; its config.json names MiniCPM3ForCausalLM
    for model_type, name in HF_ARCHITECTURES.items():
        if model_type != "minicpm3":
            assert hasattr(transformers, name), name


def test_a_hf_directory_names_its_own(tmp_path: Path) -> None:
    config = {"model_type": "llama", "architectures": ["MyLlamaForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert hf_architectures("llama", tmp_path) == ("MyLlamaForCausalLM",)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "minicpm3"}))
    assert hf_architectures("minicpm3", tmp_path) == ("MiniCPM3ForCausalLM",)


def test_an_unknown_model_type_is_an_error_not_llama(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as e:
        hf_architectures("gpt2", tmp_path / "x.gguf")
    assert str(e.value) == (
        "no Hugging Face architecture name is known for model_type 'gpt2'; known: "
        "deepseek_v2, deepseek_v3, llama, minicpm3, mistral, qwen2, qwen3, smollm "
        "(models/architectures.py)"
    )
