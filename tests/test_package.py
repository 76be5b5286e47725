"""``from kvserve import LLM, SamplingParams``, as vLLM users write it: the package's names
are the engine's own classes, imported on first use (importing kvserve loads no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_package_exports_are_the_engine_classes() -> None:
    import kvserve
    from kvserve import LLM, RequestOutput, RequestOutputKind, SamplingParams
    from kvserve.engine.llm import LLM as EngineLLM
    from kvserve.engine.request import RequestOutput as EngineOutput
    from kvserve.sampling import RequestOutputKind as Kind
    from kvserve.sampling import SamplingParams as Params

    assert (LLM, RequestOutput, RequestOutputKind, SamplingParams) == (
        EngineLLM,
        EngineOutput,
        Kind,
        Params,
    )
    assert sorted(kvserve.__all__) == [
        "LLM",
        "RequestOutput",
        "RequestOutputKind",
        "SamplingParams",
    ]
    assert set(kvserve.__all__) <= set(dir(kvserve))


def test_unknown_names_raise_attribute_error() -> None:
    import kvserve

    with pytest.raises(AttributeError, match="'kvserve' has no attribute 'Engine'"):
        kvserve.Engine  # noqa: B018
    with pytest.raises(ImportError):
        exec("from kvserve import Engine")


def test_importing_the_package_loads_no_torch() -> None:
    code = (
        "import sys, kvserve\n"
        "assert 'torch' not in sys.modules, 'import kvserve loaded torch'\n"
        "from kvserve import SamplingParams\n"
        "assert 'torch' in sys.modules\n"
        "print(SamplingParams(max_tokens=3, prompt_logprobs=1).prompt_logprobs)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "1\n"
