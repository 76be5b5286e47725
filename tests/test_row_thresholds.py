"""The quantized matmuls' measured row thresholds are kept on disk and read back by the next
load on the same machine (models/row_thresholds.py), never across machines, thread counts,
feature caps or kernel changes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import make_hf_checkpoint

from kvserve.kernels.build import build_kernels
from kvserve.models import weight_formats
from kvserve.models.loader import load_model
from kvserve.models.quantized_linear import QuantizedLinear
from kvserve.models.row_thresholds import FORMAT_VERSION, RowThresholdCache, machine_key
from kvserve.platform import detect_cpu_features


def test_a_stored_measurement_is_found_by_the_next_reader(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    first = RowThresholdCache(path, "machine-a")
    key = first.key(qtype=8, shape=[64, 32])
    assert first.get(key) is None
    first.put(key, (8, 256, 16))
    again = RowThresholdCache(path, "machine-a")
    assert again.get(again.key(qtype=8, shape=[64, 32])) == (8, 256, 16)
    assert again.hits == 1
    other = RowThresholdCache(path, "machine-b")  # another CPU / thread count / kernel build
    assert other.get(other.key(qtype=8, shape=[64, 32])) is None
    other.put(other.key(qtype=8, shape=[64, 32]), (1, 0, 0))
    # both machines' entries are kept side by side
    assert RowThresholdCache(path, "machine-a").get(key) == (8, 256, 16)


def test_remeasure_misses_and_overwrites_only_its_own_entry(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    cache = RowThresholdCache(path, "m")
    cache.put(cache.key(shape=[1]), (1, 2, 3))
    cache.put(cache.key(shape=[2]), (4, 5, 6))
    fresh = RowThresholdCache(path, "m", remeasure=True)
    assert fresh.get(fresh.key(shape=[1])) is None
    fresh.put(fresh.key(shape=[1]), (7, 8, 9))
    back = RowThresholdCache(path, "m")
    assert back.get(back.key(shape=[1])) == (7, 8, 9)
    assert back.get(back.key(shape=[2])) == (4, 5, 6)


@pytest.mark.parametrize(
    "content", ["{not json", json.dumps([1, 2]), json.dumps({"version": 99, "entries": {}})]
)
def test_a_broken_or_foreign_file_is_measured_over(tmp_path: Path, content: str) -> None:
    path = tmp_path / "t.json"
    path.write_text(content)
    cache = RowThresholdCache(path, "m")
    assert cache.get(cache.key(shape=[1])) is None
    cache.put(cache.key(shape=[1]), (1, 1, 0))
    assert RowThresholdCache(path, "m").get(cache.key(shape=[1])) == (1, 1, 0)


def test_bad_values_are_not_returned(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    cache = RowThresholdCache(path, "m")
    good, bad = cache.key(shape=[1]), cache.key(shape=[2])
    entries = {good: [1, 2, 3], bad: [1, -2, 3]}
    path.write_text(json.dumps({"version": FORMAT_VERSION, "entries": entries}))
    back = RowThresholdCache(path, "m")
    assert back.get(good) == (1, 2, 3)
    assert back.get(bad) is None


def test_the_machine_key_changes_with_threads_and_feature_caps() -> None:
    features = detect_cpu_features(cap="")  # uncapped, even when the suite runs under a cap
    capped = dataclasses.replace(features, avx512f=False, capped_to="avx2")
    assert machine_key(features, 2) == machine_key(features, 2)
    assert machine_key(features, 2) != machine_key(features, 3)
    assert machine_key(features, 2) != machine_key(capped, 2)


def test_the_second_load_reads_the_thresholds_instead_of_measuring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build_kernels()  # forced on: the thresholds are measured only where the kernels run
    ckpt, _ = make_hf_checkpoint(tmp_path, "llama")
    path = tmp_path / "thresholds.json"
    calls = []
    measure = weight_formats.measure_kernel_max_rows

    def counted(*args, **kwargs):
        calls.append(args[1:4])
        return measure(*args, **kwargs)

    monkeypatch.setattr(weight_formats, "measure_kernel_max_rows", counted)
    first = load_model(
        ckpt, "float32", quantization="q8_0", thresholds=RowThresholdCache(path, "m")
    )
    assert calls, "the first load measures"
    measured = len(calls)

    cache = RowThresholdCache(path, "m")
    second = load_model(ckpt, "float32", quantization="q8_0", thresholds=cache)
    assert len(calls) == measured  # nothing measured again
    assert cache.hits == measured

    def policies(model: torch.nn.Module) -> dict[str, object]:
        return {n: m.policy for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}

    assert policies(second.model) == policies(first.model)
    assert policies(first.model)

    # another machine key (say, a different thread count) measures again
    load_model(ckpt, "float32", quantization="q8_0", thresholds=RowThresholdCache(path, "n"))
    assert len(calls) == 2 * measured


def test_interleaved_thresholds_are_read_back_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bfloat16 model on AVX-512-BF16 without AMX measures its interleaved weights' row
    threshold (measure_interleaved_max_rows) once: the second load reads it."""
    build_kernels()
    features = detect_cpu_features()
    if not weight_formats._interleaves(features, torch.bfloat16):
        pytest.skip("the default path interleaves only on AVX-512-BF16 CPUs without AMX")
    ckpt, _ = make_hf_checkpoint(tmp_path, "llama")
    path = tmp_path / "thresholds.json"
    calls = []
    measure = weight_formats.measure_interleaved_max_rows

    def counted(*args, **kwargs):
        calls.append(args[1:4])
        return measure(*args, **kwargs)

    monkeypatch.setattr(weight_formats, "measure_interleaved_max_rows", counted)
    first = load_model(
        ckpt, "bfloat16", quantization="q8_0", thresholds=RowThresholdCache(path, "m")
    )
    assert calls, "the first load measures"
    measured = len(calls)
    cache = RowThresholdCache(path, "m")
    second = load_model(ckpt, "bfloat16", quantization="q8_0", thresholds=cache)
    assert len(calls) == measured and cache.hits == measured

    def policies(model: torch.nn.Module) -> dict[str, object]:
        return {n: m.policy for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}

    assert policies(second.model) == policies(first.model)
    assert all(
        p.interleaved and p.interleaved_max_rows >= 128 for p in policies(first.model).values()
    )
