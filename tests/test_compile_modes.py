"""The compiled step's three modes and its verdict file: "background" serves eager at once and
takes the compiled step between requests; a second start with the same key compiles without
running eager beside it again; closing the engine stops a compile in flight."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from conftest import make_hf_checkpoint

from kvserve.engine import compiled_steps
from kvserve.engine.compiled_steps import EAGER_STEPS, compile_model, warmup_token_counts
from kvserve.engine.llm import LLM
from kvserve.models.model_session import ModelSession
from kvserve.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = make_hf_checkpoint(tmp_path_factory.mktemp("compile"), "llama")
    return path


def _session(path: Path) -> ModelSession:
    # quantized: plain float weights are oneDNN-packed, which the compiled step does not take
    return ModelSession.open(str(path), "float32", "cpu", quantization="q8_0")


def test_unknown_mode_is_refused(tiny: Path) -> None:
    with pytest.raises(ValueError, match="compile_mode must be one of .*'eventually'"):
        LLM(session=_session(tiny), num_kv_blocks=16, compile_mode="eventually")


def test_off_never_compiles(tiny: Path) -> None:
    llm = LLM(session=_session(tiny), num_kv_blocks=16, compile_mode="off")
    assert llm.engine.runner.steps is EAGER_STEPS and not llm.engine.compile_result.compiled


def test_background_runs_eager_then_swaps_between_requests(tiny: Path) -> None:
    llm = LLM(session=_session(tiny), num_kv_blocks=64, block_size=4, compile_mode="background")
    engine = llm.engine
    assert engine.runner.steps is EAGER_STEPS
    assert engine.compile_result.reason == "compiling in the background"
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request([1, 2, 3, 4, 5], params)
    engine.step()  # a request is running now: a finished compile must wait for it to end
    result = engine.compiler.background.wait(600) if engine.compiler.background else None
    assert result is not None and result.compiled, result
    engine.step()
    assert engine.runner.steps is EAGER_STEPS  # still inside the running request
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request([1, 2, 3], params)
    engine.step()  # the first step with no request running before it takes the compiled one
    assert engine.runner.steps is result.steps and engine.compile_result.compiled
    while engine.has_unfinished_requests():
        engine.step()
    engine.close()


def test_close_stops_a_background_compile(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))  # nothing compiled or checked yet
    llm = LLM(session=_session(tiny), num_kv_blocks=16, compile_mode="background")
    background = llm.engine.compiler.background
    assert background is not None
    llm.engine.close()
    assert not background._thread.is_alive()
    result = background.result()
    # a cold compile takes seconds; the stop is checked before every token count
    assert result is not None and result.reason == "the engine closed while compiling"
    assert llm.engine.compiler.background is None and llm.engine.runner.steps is EAGER_STEPS


def test_a_passed_check_is_not_run_again(
    tiny: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = compiled_steps._warmup

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(compiled_steps, "_warmup", counting)
    first = _session(tiny).model
    result = compile_model(first, cache_dir=tmp_path)
    assert result.compiled and calls == [1]
    key = compiled_steps.verdict_key(first, warmup_token_counts(first))
    assert (tmp_path / compiled_steps.VERDICTS / f"{key}.json").is_file()
    caplog.set_level(logging.INFO, logger="kvserve.engine.compiled_steps")
    second = _session(tiny).model  # a new process's model: same config, same key
    again = compile_model(second, cache_dir=tmp_path)
    assert again.compiled and calls == [1]  # compiled, not compared with eager again
    assert "checked before" in caplog.text
