"""Which layer steps an engine runs, and the hand-over of a background compile.

``StepCompiler`` applies the compile mode (engine/compiled_steps.py's ``COMPILE_MODES``): "sync"
and "off" decide the steps at once; "background" starts eager and compiles in a daemon thread
(``BackgroundCompile``), whose result the engine takes (``take``) at the first step with no
request running: eager and compiled steps round differently in bfloat16, and no request should
see both. ``close`` stops a compile in flight: a process must not exit while the compiler runs
in another thread (C++ aborts: "terminate called without an active exception").
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from kvserve.engine.compiled_steps import (
    COMPILE_MODES,
    EAGER_STEPS,
    CompileResult,
    compile_model,
)
from kvserve.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


class BackgroundCompile:
    """``compile_model`` in a daemon thread; the caller polls ``result()`` between steps and
    swaps the steps in when no request is running (eager and compiled round differently in
    bfloat16, so a request never sees both)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self._result: CompileResult | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(model,), name="kvserve-compile", daemon=True
        )
        self._thread.start()

    def _run(self, model: LlamaForCausalLM) -> None:
        try:
            result = compile_model(model, stop=self._stop)
        except Exception as e:  # noqa: BLE001 - the engine runs on eager, as it already does
            reason = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            logger.warning("compiling the model step failed (%s); running eager", reason)
            result = CompileResult(EAGER_STEPS, False, 0.0, reason)
        self._result = result  # one reference assignment: atomic for the polling thread

    def result(self) -> CompileResult | None:
        """The finished compile (compiled or the eager fallback with its reason), or None."""
        return self._result

    def wait(self, timeout_s: float | None = None) -> CompileResult | None:
        self._thread.join(timeout_s)
        return self._result

    def cancel(self, timeout_s: float = 60.0) -> None:
        """Stop at the next token count and wait for the thread."""
        self._stop.set()
        self._thread.join(timeout_s)


class StepCompiler:
    """The engine's layer steps as its compile mode decides them. ``result`` is what runs now;
    ``background`` is the compile in flight ("background" mode only, until taken or closed)."""

    def __init__(self, model: LlamaForCausalLM, enforce_eager: bool, mode: str) -> None:
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got {mode!r}")
        self.background: BackgroundCompile | None = None
        if mode == "background" and not enforce_eager:
            eager = compile_model(model, enforce_eager=True)
            self.result = dataclasses.replace(eager, reason="compiling in the background")
            self.background = BackgroundCompile(model)
        else:
            self.result = compile_model(model, enforce_eager or mode == "off")

    def take(self, requests_running: bool) -> CompileResult | None:
        """The finished background compile, once, when no request is running; else None."""
        done = None if self.background is None else self.background.result()
        if done is None or requests_running:
            return None
        self.background = None
        self.result = done
        return done

    def wait(self, timeout_s: float | None = None) -> None:
        if self.background is not None:
            self.background.wait(timeout_s)

    def close(self) -> None:
        if self.background is not None:
            self.background.cancel()
            self.background = None
