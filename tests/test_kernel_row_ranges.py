"""How ``measure_kernel_max_rows`` turns timings into a weight's row ranges (the float32
kernel, the bf16 kernel or its AMX tiles, dequantize + matmul).

The timings are faked (``best_time`` replaced), so these check the decisions, not the
machine: they need no compiled kernels and run on every CPU, whatever paths it has. The
closures the measurement times are named ``kernel`` (the float32 kernel), ``dequantized``
(dequantize + F.linear) and a lambda (the bf16 kernel / AMX tiles).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from kvserve.kernels.quant_ref import quantize
from kvserve.models import quantized_linear


def weight(qtype: QT) -> torch.Tensor:
    """An (8, 64) quantized weight: its values do not matter, the timings are faked."""
    return quantize(torch.randn(8, 64, generator=torch.Generator().manual_seed(0)), qtype)


def rows_of(kernel_fn) -> int:
    """Activation rows of the timed ``kernel`` closure (its x is bound as a default)."""
    return kernel_fn.__defaults__[0].shape[0]


def test_one_noisy_loss_does_not_end_the_kernel_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """measure_kernel_max_rows confirms a loss of the kernel with longer timings before it
    ends the kernel's range: one slow sample (a busy machine at load) once gave a weight
    "kernel up to 0 rows", and batch-1 decode then dequantized every weight every step."""
    kernel_timings = []

    def noisy_best_time(fn, repeat):
        if fn.__name__ == "kernel":  # the very first kernel timing is a stall, then fast
            kernel_timings.append(repeat)
            return 1.0 if len(kernel_timings) == 1 else 0.0
        return 0.5

    monkeypatch.setattr(quantized_linear, "best_time", noisy_best_time)
    rows, bf16_rows, amx_rows = quantized_linear.measure_kernel_max_rows(
        weight(QT.Q4_1), int(QT.Q4_1), 8, 64, isa=-1, candidates=(1, 2)
    )
    assert (rows, bf16_rows, amx_rows) == (2, 0, 0)
    assert kernel_timings == [3, 9, 3]  # the loss at 1 row re-timed 3x longer, then 2 rows


def test_one_noisy_loss_to_the_bf16_kernel_does_not_end_the_kernel_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same confirmation against the bf16 kernel: one stalled first timing once gave the
    Q8_0 lm_head "kernel up to 0 rows" on an AMX Xeon, and batch-1 decode took the slower
    bf16 kernel on every step."""
    kernel_timings = []

    def noisy_best_time(fn, repeat):
        if fn.__name__ == "kernel":  # a stall first, then clearly faster than the bf16 kernel
            kernel_timings.append(repeat)
            return 1.0 if len(kernel_timings) == 1 else 0.1
        if fn.__name__ == "dequantized":
            return 2.0
        return 0.5  # the bf16 kernel (a lambda), never below its best

    monkeypatch.setattr(quantized_linear, "best_time", noisy_best_time)
    w = weight(QT.Q8_0)
    args = (w, int(QT.Q8_0), 8, 64, -1)
    kw = {"bf16": True, "bf16_kernel": True, "candidates": (1, 2)}
    assert quantized_linear.measure_kernel_max_rows(*args, **kw) == (2, 0, 0)
    assert kernel_timings == [3, 9, 3]

    # a real loss (the kernel slower in the longer timings too) still ends the range
    monkeypatch.setattr(
        quantized_linear,
        "best_time",
        lambda fn, repeat: {"kernel": 1.0, "dequantized": 2.0}.get(fn.__name__, 0.5),
    )
    assert quantized_linear.measure_kernel_max_rows(*args, **kw) == (0, 2, 0)


def test_on_amx_cpus_the_bf16_range_is_all_amx_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """With AMX, every row above the float32 kernel's range that the bf16 path takes runs on
    AMX tiles (amx_min_rows = kernel_max_rows + 1), never the VDPBF16PS tiles: a real decode
    step streams each weight once, and there AMX won at every row count."""

    def fake_best_time(fn, repeat):
        if fn.__name__ == "kernel":  # wins at 1 and 2 rows, loses from 4
            return 0.1 if rows_of(fn) <= 2 else 1.0
        return 2.0 if fn.__name__ == "dequantized" else 0.5

    monkeypatch.setattr(quantized_linear, "best_time", fake_best_time)
    w = weight(QT.Q4_1)
    args = (w, int(QT.Q4_1), 8, 64, -1)
    kw = {"bf16": True, "bf16_kernel": True, "candidates": (1, 2, 4, 8)}
    assert quantized_linear.measure_kernel_max_rows(*args, **kw, amx=True) == (2, 8, 3)
    # without AMX the same range is the VDPBF16PS tiles'
    assert quantized_linear.measure_kernel_max_rows(*args, **kw, amx=False) == (2, 8, 0)


def test_one_noisy_loss_of_the_bf16_kernel_does_not_end_its_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A loss of the bf16 kernel to dequantize + matmul is confirmed with longer timings too:
    one stalled sample at a busy first start gave the default model's qkv_proj "bf16 kernel
    up to 16 rows" on a Zen 4 (quiet: 512), and that cached range slowed offline-64 by 13%."""
    bf16_timings = []

    def noisy_best_time(fn, repeat):
        if fn.__name__ == "kernel":  # the float32 kernel loses from the first row
            return 1.0
        if fn.__name__ == "dequantized":
            return 0.5
        bf16_timings.append(repeat)  # the bf16 kernel: a stall at its second timing only
        return 1.0 if len(bf16_timings) == 2 else 0.1

    monkeypatch.setattr(quantized_linear, "best_time", noisy_best_time)
    args = (weight(QT.Q4_1), int(QT.Q4_1), 8, 64, -1)
    kw = {"bf16": True, "bf16_kernel": True, "candidates": (1, 2, 4)}
    assert quantized_linear.measure_kernel_max_rows(*args, **kw) == (0, 4, 0)
    assert bf16_timings == [3, 3, 9, 3]  # the loss at 2 rows re-timed 3x longer

    # a real loss (slower in the longer timing too) still ends the range
    bf16_timings.clear()

    def slow_from_two_rows(fn, repeat):
        if fn.__name__ in ("kernel", "dequantized"):
            return 1.0 if fn.__name__ == "kernel" else 0.5
        bf16_timings.append(repeat)
        return 0.1 if len(bf16_timings) == 1 else 1.0

    monkeypatch.setattr(quantized_linear, "best_time", slow_from_two_rows)
    assert quantized_linear.measure_kernel_max_rows(*args, **kw) == (0, 1, 0)
    assert bf16_timings == [3, 3, 9]
