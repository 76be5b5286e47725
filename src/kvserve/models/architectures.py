"""The Hugging Face architecture name of each model family kvserve loads.

Routers (SGLang's) read a replica's ``architectures`` (/model_info, /server_info) to tell
models apart. A HF checkpoint names its own in config.json; a GGUF file does not, so its name
comes from ``HF_ARCHITECTURES``, keyed by the ``model_type`` the loader built the model for.
Every key of the model registries (``MODEL_REGISTRY``, ``DEEPSEEK_REGISTRY``) is in the table
(test_architectures holds them equal): a family added without its name is an error there,
never reported as Llama.
"""

from __future__ import annotations

import json
from pathlib import Path

# model_type (ModelConfig / DeepseekConfig) -> transformers' class name for it
HF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "smollm": "LlamaForCausalLM",  # SmolLM checkpoints are Llama ones
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "minicpm3": "MiniCPM3ForCausalLM",
}


def hf_architectures(model_type: str, checkpoint: Path) -> tuple[str, ...]:
    """The checkpoint's own ``architectures`` (a HF directory's config.json lists them), else
    the table's name for ``model_type``; ValueError for a model type the table lacks."""
    config = Path(checkpoint) / "config.json"
    if config.is_file():
        try:
            listed = json.loads(config.read_text(encoding="utf-8")).get("architectures")
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(f"cannot read 'architectures' from {config}: {e}") from e
        if isinstance(listed, list) and listed and all(isinstance(a, str) for a in listed):
            return tuple(listed)
    if model_type not in HF_ARCHITECTURES:
        raise ValueError(
            f"no Hugging Face architecture name is known for model_type {model_type!r}; "
            f"known: {', '.join(sorted(HF_ARCHITECTURES))} (models/architectures.py)"
        )
    return (HF_ARCHITECTURES[model_type],)
