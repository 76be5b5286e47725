"""kvserve: an LLM inference engine built around its KV cache.

``from kvserve import LLM, SamplingParams`` as with vLLM. Both are imported on first use, so
importing the package (as the server's torch-free modules do) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.engine.llm import LLM
    from kvserve.engine.request import RequestOutput
    from kvserve.sampling import RequestOutputKind, SamplingParams

__all__ = ["LLM", "RequestOutput", "RequestOutputKind", "SamplingParams"]

_WHERE = {
    "LLM": "kvserve.engine.llm",
    "RequestOutput": "kvserve.engine.request",
    "RequestOutputKind": "kvserve.sampling",
    "SamplingParams": "kvserve.sampling",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
