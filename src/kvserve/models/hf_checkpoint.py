"""Reading a Hugging Face checkpoint directory: config.json and safetensors (single or sharded)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from kvserve.models.config import ModelConfig
from kvserve.models.deepseek_config import DEEPSEEK_MODEL_TYPES, DeepseekConfig


def read_hf_config(model_dir: Path) -> ModelConfig | DeepseekConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; is it a Hugging Face model dir?")
    cfg = json.loads(path.read_text())
    if cfg.get("model_type") in DEEPSEEK_MODEL_TYPES:
        config = DeepseekConfig.from_hf(cfg)
    else:
        config = ModelConfig.from_hf(cfg)
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        # generation_config.json may list more stop ids (Llama 3 instruct: <|eot_id|>).
        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        extra = gen_eos if isinstance(gen_eos, list) else ([] if gen_eos is None else [gen_eos])
        merged = tuple(dict.fromkeys([*config.eos_token_ids, *extra]))
        if merged != config.eos_token_ids:
            config = replace(config, eos_token_ids=merged)
    return config


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files: the shards an index names, or every *.safetensors file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards named in {index.name} are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
    return files


def count_hf_tensors(model_dir: Path) -> int:
    total = 0
    for f in safetensors_files(model_dir):
        with safe_open(f, framework="pt") as st:
            total += len(st.keys())
    return total


def iter_hf_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF weight name, tensor) for every tensor of every shard, lazily."""
    seen: set[str] = set()
    for f in safetensors_files(model_dir):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                if name in seen:
                    raise ValueError(f"tensor {name!r} appears in more than one shard ({f.name})")
                seen.add(name)
                yield name, st.get_tensor(name)
