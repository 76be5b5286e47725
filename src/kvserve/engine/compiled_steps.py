"""The compiled model step: each decoder layer's two halves through torch.compile (inductor).

Eager PyTorch spends a decode step of a small model mostly between matmuls: ~600 small ops
(norms, rotary, activations, residual adds, dtype casts) for 30 layers, each a dispatch and a
pass over memory. Compiling fuses them into a few C++ loops per half-layer, around the matmul
ops it cannot see into (the quantized kernels are custom ops with Meta kernels).

What is compiled is ``LlamaDecoderLayer.before_attention`` (norm, q/k/v projections, q/k norm,
rotary) and ``after_attention`` (o_proj, residual, norm, MLP, residual); attention, which
reads and writes the paged cache through per-step metadata, stays eager between them. The same
two graphs serve every layer (weights are graph inputs), prefill and decode alike: shapes are
dynamic in the token count, so there are no batch buckets to pad to. Graph variants come only
from guards (a token count of 1 is specialized; a quantized layer's kernel-vs-dequant row
threshold splits the range), and are all compiled at start-up by a warm-up.

Compiled code is cached on disk (inductor's FX graph cache in ``cache_dir``), so a second
start with the same model shapes skips the C++ compilation. If compiling fails, or the
compiled warm-up differs from eager, the model runs eager and one warning says why. A warm-up
that passed leaves a verdict file keyed by everything the compiled graphs depend on (model
config, dtype, token counts, torch, kvserve's kernels, the CPU's features): a later start with
the same key only compiles, without running eager beside it again.

Three modes (``COMPILE_MODES``): "sync" compiles before the first step (offline jobs,
benchmarks), "background" runs eager at once and hands the compiled step over when it is ready
(engine/step_compiler.py; the server and chat, whose first reply should not wait), "off"
never compiles (one-shot ``generate``, where compiling costs more than it saves).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvserve.attention.no_cache import NoCacheAttention
from kvserve.models.llama import EAGER_STEPS, LayerSteps, LlamaDecoderLayer, LlamaForCausalLM
from kvserve.models.packed_linear import PackedLinear

logger = logging.getLogger(__name__)

# distinct (shape-guard) variants of each half: 1 token, the small-batch range, prefill sizes,
# and the splits the quantized layers' row thresholds add; the default of 8 would silently
# fall back to eager after the eighth
RECOMPILE_LIMIT = 64
COMPILE_MODES = ("sync", "background", "off")
VERDICTS = "verdicts"  # under the inductor cache dir: one file per accepted key


def default_cache_dir() -> Path:
    root = os.environ.get("KVSERVE_CACHE_DIR") or str(Path.home() / ".cache" / "kvserve")
    return Path(root) / "inductor"


@dataclass(slots=True)
class CompileResult:
    steps: LayerSteps
    compiled: bool
    seconds: float
    reason: str  # why eager, or "" when compiled


def warmup_token_counts(model: LlamaForCausalLM) -> list[int]:
    """Token counts that hit every guard variant: 1, 2, each quantized layer's row threshold
    and one past it, and a prefill-sized count."""
    counts = {1, 2, 3, 64}
    for m in model.modules():
        policy = getattr(m, "policy", None)
        if policy is not None and policy.use_kernels:
            counts.update((max(policy.kernel_max_rows, 2), policy.kernel_max_rows + 1))
            if policy.bf16_kernel_max_rows:
                counts.update((policy.bf16_kernel_max_rows, policy.bf16_kernel_max_rows + 1))
            if policy.amx_min_rows:
                counts.update((policy.amx_min_rows - 1, policy.amx_min_rows))
    return sorted(counts)


@dataclass(slots=True)
class WarmupCheck:
    max_diff: float  # largest |compiled - eager| logit
    top1_agreement: float  # share of positions where both pick the same token


@torch.inference_mode()
def _warmup(
    model: LlamaForCausalLM, steps: LayerSteps, counts: list[int], stop: threading.Event
) -> WarmupCheck:
    """Runs steps at each token count (compiling each variant) against eager."""
    worst, agree, total = 0.0, 0, 0
    g = torch.Generator().manual_seed(0)
    attn = NoCacheAttention(model.config.attention_scale)
    for t in counts:
        _check_stop(stop)
        ids = torch.randint(0, model.config.vocab_size, (t,), generator=g).to(model.device)
        pos = torch.arange(t, device=model.device)
        want = model.compute_logits(model(ids, pos, attn, EAGER_STEPS))
        got = model.compute_logits(model(ids, pos, attn, steps))
        worst = max(worst, float((got - want).abs().max()))
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += t
    return WarmupCheck(worst, agree / total)


class CompileCancelled(Exception):
    """The process is closing the engine while its background compile runs."""


def _check_stop(stop: threading.Event) -> None:
    if stop.is_set():
        raise CompileCancelled("the engine closed while compiling")


@torch.inference_mode()
def _compile_only(
    model: LlamaForCausalLM, steps: LayerSteps, counts: list[int], stop: threading.Event
) -> None:
    """Runs the compiled steps at each token count: compiles (or loads) every variant."""
    attn = NoCacheAttention(model.config.attention_scale)
    for t in counts:
        _check_stop(stop)
        ids = torch.zeros(t, dtype=torch.long, device=model.device)
        model(ids, torch.arange(t, device=model.device), attn, steps)


def verdict_key(model: LlamaForCausalLM, counts: list[int]) -> str:
    """What the compiled graphs and their check depend on (weights are graph inputs, so their
    values are not part of it)."""
    from kvserve.kernels.build import build_key
    from kvserve.platform import detect_cpu_features

    parts = {
        "config": repr(model.config),
        "dtype": str(model.dtype),
        "device": str(model.device),
        "counts": counts,
        "torch": torch.__version__,
        "kernels": build_key(),
        "cpu": asdict(detect_cpu_features(os.environ.get("KVSERVE_CPU_FEATURES"))),
        "formats": sorted({type(m).__name__ for m in model.modules()}),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _check_ok(check: WarmupCheck, dtype: torch.dtype) -> bool:
    if dtype == torch.float32:
        # fusion reorders float arithmetic, nothing more (measured on logits of ~20, the
        # default model: 1.4e-3 at 2049 tokens on a Zen 5, 1.02e-2 over the warm-up counts on
        # a Zen 3, whose AVX2 code sums in other orders); a compiler bug scrambles logits by
        # whole units
        return check.max_diff <= 5e-2 and check.top1_agreement >= 0.99
    # bfloat16/float16: inductor keeps fused intermediates in float32 where eager rounds
    # after every op, so logits legitimately drift over the layers (several units on random
    # tokens measured); a compiler bug would scramble the predictions instead
    return math.isfinite(check.max_diff) and check.top1_agreement >= 0.9


def compile_model(
    model: LlamaForCausalLM,
    enforce_eager: bool = False,
    cache_dir: Path | None = None,
    stop: threading.Event | None = None,
) -> CompileResult:
    """The layer steps for ``model``: compiled and checked against eager, or eager. ``stop``
    (a background compile's) ends it between token counts with eager steps."""
    stop = stop or threading.Event()
    if enforce_eager:
        return CompileResult(EAGER_STEPS, False, 0.0, "enforce_eager")
    if not isinstance(model, LlamaForCausalLM):
        # the compiled halves are LlamaDecoderLayer's; other families' layers run eager
        reason = f"{type(model).__name__} layers are not compiled (Llama family only)"
        logger.info("model step runs eager: %s", reason)
        return CompileResult(EAGER_STEPS, False, 0.0, reason)
    if any(isinstance(m, PackedLinear) for m in model.modules()):
        # oneDNN-packed weights are opaque tensors that inductor cannot trace (measured: it
        # fails in lowering); packed eager GEMVs are within ~1.3x of compiled plain ones
        reason = "dense oneDNN-packed weights (compile runs on quantized or plain weights)"
        logger.info("model step runs eager: %s", reason)
        return CompileResult(EAGER_STEPS, False, 0.0, reason)
    if isinstance(model.compiled_steps, CompileResult):
        # an earlier engine of this process compiled and checked these very weights (a CLI
        # chat, a server restarting its loop): the same graphs serve, no second trace
        return model.compiled_steps
    cache_dir = cache_dir or default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    # inductor reads its cache location from the environment when it compiles; kvserve's
    # own location (under $KVSERVE_CACHE_DIR) wins over torch's /tmp default
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    dynamo_config = torch._dynamo.config
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    counts = warmup_token_counts(model)
    logger.warning(
        "compiling the model step (torch.compile, %d token-count variants; cached in %s; "
        "--enforce-eager skips this)",
        len(counts),
        os.environ["TORCHINDUCTOR_CACHE_DIR"],
    )
    start = time.perf_counter()
    steps = LayerSteps(
        torch.compile(LlamaDecoderLayer.before_attention, dynamic=True),
        torch.compile(LlamaDecoderLayer.after_attention, dynamic=True),
    )
    verdict = cache_dir / VERDICTS / f"{verdict_key(model, counts)}.json"
    try:
        if verdict.is_file():
            # the same graphs passed the check against eager before: compile, don't re-check
            _compile_only(model, steps, counts, stop)
            seconds = time.perf_counter() - start
            logger.info("compiled the model step in %.1f s (checked before: %s)", seconds, verdict)
            model.compiled_steps = CompileResult(steps, True, seconds, "")
            return model.compiled_steps
        check = _warmup(model, steps, counts, stop)
    except CompileCancelled as e:
        return CompileResult(EAGER_STEPS, False, time.perf_counter() - start, str(e))
    except Exception as e:  # noqa: BLE001 - any compiler failure means "run eager"
        reason = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        logger.warning("torch.compile failed (%s); running eager", reason)
        return CompileResult(EAGER_STEPS, False, time.perf_counter() - start, reason)
    seconds = time.perf_counter() - start
    if not _check_ok(check, model.dtype):
        reason = (
            f"compiled logits differ from eager (max diff {check.max_diff:.3g}, top-1 "
            f"agreement {check.top1_agreement:.2f})"
        )
        logger.warning("%s; running eager", reason)
        return CompileResult(EAGER_STEPS, False, seconds, reason)
    logger.info(
        "compiled the model step in %.1f s (max logit diff to eager %.2g, top-1 agreement %.2f)",
        seconds,
        check.max_diff,
        check.top1_agreement,
    )
    _write_verdict(verdict, check)
    model.compiled_steps = CompileResult(steps, True, seconds, "")
    return model.compiled_steps


def _write_verdict(path: Path, check: WarmupCheck) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(check)))
    os.replace(tmp, path)  # a reader sees no verdict or a whole one
