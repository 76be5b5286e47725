"""The default model with its 4-bit weights kept quantized, against HF transformers loading the
same GGUF (which dequantizes it to float32): the fast paths (C++ kernels, the compiled step, the
paged decode kernel) and the slow ones they are tested against, all in float32.

Reported (``-rA`` shows them; also as junit properties): teacher-forced top-1 agreement and the
largest logit difference to transformers for each weight path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.engine.llm import LLM
from kvserve.models.loader import load_model
from kvserve.models.model_session import ModelSession
from kvserve.reference.decoders import full_logits
from kvserve.sampling import SamplingParams

STEPS = 32
CHAT = [{"role": "user", "content": "Write a short paragraph about the history of Paris."}]


@pytest.fixture(scope="module")
def session(default_gguf: Path) -> ModelSession:
    return ModelSession.open(default_gguf, "float32", "cpu")


@pytest.fixture(scope="module")
def prompt(session: ModelSession) -> list[int]:
    return session.require_tokenizer().apply_chat_template(CHAT)


@pytest.fixture(scope="module")
def hf_model(default_gguf: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def hf_tokens(hf_model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        # no min_new_tokens: transformers would mask EOS out of the logits until then
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False)
    tokens = out[0, len(prompt) :].tolist()
    assert len(tokens) == STEPS, "the prompt should make the model write past 32 tokens"
    return tokens


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=STEPS, temperature=0.0)


def test_weights_stay_quantized(session: ModelSession, default_gguf: Path) -> None:
    report = session.weights
    assert report.tensors_by_format == {"Q4_1": 210, "Q8_0": 1}
    # resident bytes ~ the file's size (the file also holds the vocabulary and metadata)
    file_bytes = default_gguf.stat().st_size
    assert 0.85 * file_bytes < report.resident_bytes < 1.0 * file_bytes


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["compiled", "eager"])
def test_engine_greedy_matches_transformers(
    session: ModelSession, prompt: list[int], hf_tokens: list[int], enforce_eager: bool
) -> None:
    llm = LLM(session=session, max_num_seqs=4, enforce_eager=enforce_eager)
    assert llm.engine.compile_result.compiled is not enforce_eager, llm.engine.compile_result
    (out,) = llm.generate([prompt], greedy(), use_tqdm=False)
    assert out.token_ids == hf_tokens


# "native": the best kernels this CPU runs; "avx2": the same machine capped as a Zen 3 (the
# AVX2 kernels); "reference": the C++ extension off (PyTorch dequantize + matmul)
@pytest.mark.parametrize("path", ["native", "avx2", "reference"])
def test_teacher_forced_agreement_with_transformers(
    default_gguf: Path,
    hf_model,
    prompt: list[int],
    hf_tokens: list[int],
    path: str,
    monkeypatch: pytest.MonkeyPatch,
    record_property,
) -> None:
    from conftest import hf_logits

    from kvserve.platform import detect_cpu_features

    if path == "reference":
        monkeypatch.setenv("KVSERVE_KERNELS", "0")
    features = detect_cpu_features("avx2" if path == "avx2" else None)
    loaded = load_model(default_gguf, "float32", "cpu", features=features)
    expected_path = "reference" if path == "reference" else "kernel"
    assert all(p.startswith(expected_path) for p in loaded.weights.paths.values())
    ids = prompt + hf_tokens
    got = full_logits(loaded.model, ids)[len(prompt) - 1 : -1]  # predicts hf_tokens
    want = hf_logits(hf_model, ids)[len(prompt) - 1 : -1]
    agreement = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    max_diff = float((got - want).abs().max())
    record_property("top1_agreement", agreement)
    record_property("max_logit_diff", max_diff)
    print(f"{path}: top-1 agreement {agreement:.3f}, max logit diff {max_diff:.2e}")
    assert agreement == 1.0
    # the same dequantized weights; only the summation order differs
    assert max_diff < 2e-3
