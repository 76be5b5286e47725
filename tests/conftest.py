"""Shared helpers for tests: tiny random-weight checkpoints, as Hugging Face dirs and GGUF files.

Everything here is small (vocab 128, hidden 64, 2 layers) so a checkpoint is built, saved and
loaded in well under a second. Weights are re-randomised after construction (norm weights and
biases too, which HF initialises to ones/zeros) with a scale that keeps attention peaked, so
a wrong rotary layout, a swapped q/k norm or a dropped bias shows up in the logits.

Also helpers shared by test files split in two: the KVCacheManager steps of
test_kv_manager.py / test_kv_fork.py and the CLI runners of test_cli.py / test_cli_no_model.py.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Each test run has its own KVSERVE_CACHE_DIR (C++ kernels, inductor's cache and the compiled
# step's verdicts, row thresholds), set before kvserve reads it: no earlier run, other checkout
# or killed process decides which path a test takes or makes it wait. The run builds the
# kernels once (a minute or two on 2 cores). KVSERVE_TEST_CACHE_DIR names a directory to use
# instead (kept), for a developer re-running tests who accepts that sharing.
if os.environ.get("KVSERVE_TEST_CACHE_DIR"):
    os.environ["KVSERVE_CACHE_DIR"] = os.environ["KVSERVE_TEST_CACHE_DIR"]
else:
    _RUN_CACHE_DIR = tempfile.mkdtemp(prefix="kvserve-test-cache-")
    os.environ["KVSERVE_CACHE_DIR"] = _RUN_CACHE_DIR
    atexit.register(shutil.rmtree, _RUN_CACHE_DIR, ignore_errors=True)
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from kvserve import cli
from kvserve.engine.request import Request
from kvserve.kv.manager import KVCacheManager
from kvserve.sampling import SamplingParams

TINY_SIZES: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# HF model_type -> the general.architecture llama.cpp's converter writes for it.
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "smollm": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}

_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


# --------------------------------------------------------------------------------------------
# Hugging Face checkpoints


def tiny_hf_config(model_type: str, **overrides: Any):
    """A transformers config of ``model_type`` with TINY_SIZES, updated by ``overrides``."""
    return AutoConfig.for_model(model_type, **{**TINY_SIZES, **overrides})


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Re-draw every parameter, deterministically from ``seed``.

    Matrices ~ N(0, 1/fan_in) (unit-scale activations, peaked attention), embeddings ~ N(0, 1),
    norm weights ~ 1 + N(0, 0.2^2) (not all ones), biases ~ N(0, 0.5^2) (not zero).
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 1 and "norm" in name:
            new = 1.0 + 0.2 * torch.randn(p.shape, generator=gen)
        elif p.ndim == 1:
            new = 0.5 * torch.randn(p.shape, generator=gen)
        elif "embed_tokens" in name:
            new = torch.randn(p.shape, generator=gen)
        else:
            new = torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5
        p.copy_(new.to(p.dtype))
    return model


def make_hf_model(model_type: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A tiny transformers causal LM in float32 (eager attention) with random weights."""
    torch.manual_seed(seed)
    config = tiny_hf_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    randomize_(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def make_hf_checkpoint(
    tmp_path: Path,
    model_type: str,
    *,
    seed: int = 0,
    name: str = "hf",
    max_shard_size: int | str | None = None,
    **config_overrides: Any,
) -> tuple[Path, PreTrainedModel]:
    """Build a tiny random model and ``save_pretrained`` it (safetensors) to tmp_path/name.

    Returns (checkpoint directory, the float32 HF model it was saved from).
    """
    model = make_hf_model(model_type, seed=seed, **config_overrides)
    directory = tmp_path / name
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    try:
        model.save_pretrained(directory, **kwargs)
    except TypeError:  # transformers without the safe_serialization switch (always safetensors)
        kwargs.pop("safe_serialization")
        model.save_pretrained(directory, **kwargs)
    return directory, model


@torch.inference_mode()
def hf_logits(model: PreTrainedModel, token_ids: torch.Tensor | list[int]) -> torch.Tensor:
    """transformers' logits (T, vocab) as float32 for one unbatched sequence."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(1, -1)
    return model(input_ids=ids, use_cache=False).logits[0].float()


def random_token_ids(
    n: int, vocab_size: int = TINY_SIZES["vocab_size"], seed: int = 0
) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=gen).tolist()


# --------------------------------------------------------------------------------------------
# GGUF checkpoints, written the way llama.cpp's convert_hf_to_gguf.py writes them


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.LlamaModel.permute: HF rotate-half rows -> llama.cpp interleaved."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def hf_to_gguf_name(name: str) -> str:
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    prefix, _, rest = name.partition(".layers.")
    assert prefix == "model", name
    layer, _, suffix = rest.partition(".")
    return f"blk.{layer}.{_GGUF_LAYER[suffix]}"


def gguf_float_tensors(model: PreTrainedModel, arch: str | None = None) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp names as float32 arrays, in converter order.

    For arch "llama" the q/k rows are permuted exactly as llama.cpp does; qwen2/qwen3 are not.
    A tied model gets no output.weight (as llama.cpp writes it).
    """
    cfg = model.config
    arch = arch or GGUF_ARCH[cfg.model_type]
    out: dict[str, np.ndarray] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.endswith("rotary_emb.inv_freq"):
            continue
        w = tensor.detach().float().numpy().copy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        out[hf_to_gguf_name(name)] = np.ascontiguousarray(w)
    return out


TensorSpec = np.ndarray | tuple[np.ndarray, GGMLQuantizationType]


def write_gguf(
    path: Path,
    config: Any,
    tensors: Mapping[str, TensorSpec],
    *,
    arch: str | None = None,
    write_vocab_size: bool = True,
    extra_metadata: Callable[[GGUFWriter], None] | None = None,
) -> Path:
    """Write a GGUF file: llama.cpp's metadata keys for ``config`` (an HF config) + tensors.

    A tensor is a float array (F32/F16 by dtype) or ``(raw uint8 blocks, quant type)``.
    """
    arch = arch or GGUF_ARCH[config.model_type]
    writer = GGUFWriter(path, arch)
    writer.add_name("tiny-test-model")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads or heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if head_dim != config.hidden_size // heads or arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if write_vocab_size:
        writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    if extra_metadata is not None:
        extra_metadata(writer)
    for name, spec in tensors.items():
        if isinstance(spec, tuple):
            data, qtype = spec
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(name, spec)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def make_gguf_checkpoint(
    path: Path, model: PreTrainedModel, *, arch: str | None = None, **kwargs: Any
) -> Path:
    """The float32 GGUF twin of an HF model (see gguf_float_tensors / write_gguf)."""
    tensors = gguf_float_tensors(model, arch)
    return write_gguf(path, model.config, tensors, arch=arch, **kwargs)


@pytest.fixture
def hf_checkpoint(tmp_path: Path) -> Callable[..., tuple[Path, PreTrainedModel]]:
    """Fixture form of make_hf_checkpoint bound to this test's tmp_path."""

    def make(model_type: str = "llama", **kwargs: Any) -> tuple[Path, PreTrainedModel]:
        return make_hf_checkpoint(tmp_path, model_type, **kwargs)

    return make


# --------------------------------------------------------------------------------------------
# KVCacheManager on a small pool (10 blocks of 4 tokens): test_kv_manager.py, test_kv_fork.py

NUM_BLOCKS = 10
BS = 4


def make_request(rid: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(),
        cache_salt=cache_salt,
    )


@pytest.fixture
def kv() -> KVCacheManager:
    return KVCacheManager(NUM_BLOCKS, BS)


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.pool.free_queue]


def refs(kv: KVCacheManager, ids: list[int]) -> list[int]:
    return [kv.pool.blocks[i].ref_cnt for i in ids]


def prefill(kv: KVCacheManager, req: Request) -> tuple[list[int], int]:
    """Schedule the whole prompt at once, as the scheduler does on admission, run the 'step'
    and register full blocks. Returns (ids of the newly allocated blocks, tokens hit)."""
    computed, num_hit = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, req.num_tokens - num_hit, computed)
    assert new is not None
    kv.record_prefix_lookup(req.num_tokens, num_hit)
    kv.check_integrity()
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req, req.num_computed_tokens)
    kv.check_integrity()
    return [b.block_id for b in new], num_hit


def decode(kv: KVCacheManager, req: Request, token: int) -> list[int]:
    """Append one token and make room for it (the token sampled last step gets computed)."""
    req.all_token_ids.append(token)
    new = kv.allocate_slots(req, 1)
    assert new is not None
    req.num_computed_tokens += 1
    kv.cache_blocks(req, req.num_computed_tokens)
    kv.check_integrity()
    return [b.block_id for b in new]


def finish(kv: KVCacheManager, req: Request) -> None:
    kv.free(req)
    kv.check_integrity()


def assert_no_leaks(kv: KVCacheManager) -> None:
    kv.check_integrity()
    assert kv.req_to_blocks == {}
    assert kv.num_cached_blocks == {}
    assert kv.pool.num_free_blocks == NUM_BLOCKS
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert sorted(free_ids(kv)) == list(range(NUM_BLOCKS))
    for h, block in kv.pool.cached.items():
        assert block.block_hash == h


# --------------------------------------------------------------------------------------------
# The embedded default model: test_gguf.py, test_default_model.py


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    from kvserve.default_model import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))


# --------------------------------------------------------------------------------------------
# The command line: test_cli.py, test_cli_no_model.py


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


# --------------------------------------------------------------------------------------------
# The HTTP server: test_server*.py (helpers in server_helpers.py)

SERVER_API_KEY = "test-key-123"


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from server_helpers import build_chat_checkpoint

    return build_chat_checkpoint(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="session")
def server(chat_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    """One `kvserve serve` process with an API key, shared by the server tests."""
    from server_helpers import start_server

    proc = start_server(
        chat_checkpoint, tmp_path_factory.mktemp("logs"), "--log-interval", "1",
        api_key=SERVER_API_KEY,
    )  # fmt: skip
    yield proc
    proc.stop()
