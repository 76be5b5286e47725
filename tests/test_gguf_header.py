"""The fast GGUF header walk (models/gguf_header.py) reads what gguf.GGUFReader reads: the
same metadata (long arrays as their length), the same tensors with the same data views; and
the files it does not read go to GGUFReader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import make_hf_model, write_gguf
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from kvserve.kernels.quant_ref import quantize
from kvserve.models.gguf_checkpoint import open_gguf, read_gguf_metadata
from kvserve.models.gguf_header import LONG_ARRAY, UnsupportedHeader, read_gguf_header


def assert_same_as_reader(path: Path, compare_all_data: bool = True) -> None:
    reader = GGUFReader(path)
    header = read_gguf_header(path)
    want = read_gguf_metadata(reader)
    assert header.metadata.keys() == want.keys()
    for key, value in want.items():
        got = header.metadata[key]
        if isinstance(value, float):  # float32 fields: both unpacked from the same 4 bytes
            assert got == pytest.approx(value, rel=0, abs=0), key
        else:
            assert got == value, key
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type, ours.name
        assert ours.shape == tuple(int(d) for d in theirs.shape), ours.name
        assert ours.data.dtype == theirs.data.dtype, ours.name
        assert ours.data.shape == theirs.data.shape, ours.name
        if compare_all_data or ours is header.tensors[-1]:
            assert np.array_equal(ours.data, theirs.data), ours.name


def test_the_default_model_reads_as_gguf_reader_reads_it(default_gguf: Path) -> None:
    assert_same_as_reader(default_gguf)
    meta = read_gguf_header(default_gguf).metadata
    assert meta["tokenizer.ggml.tokens"] == range(49152)  # skipped over, kept as its length


def test_float_and_block_tensors_and_short_and_long_arrays(tmp_path: Path) -> None:
    model = make_hf_model("llama")
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    q = quantize(model.model.layers[0].mlp.up_proj.weight.detach().float(), 8).numpy()

    def extra(writer) -> None:
        writer.add_array("test.short", [1, 2, 3])
        writer.add_array("test.long_ints", list(range(LONG_ARRAY + 5)))
        writer.add_array("test.long_strings", [f"t{i}" for i in range(LONG_ARRAY + 5)])
        writer.add_array("test.short_strings", ["a", "bc"])
        writer.add_bool("test.flag", True)
        writer.add_float64("test.f64", 0.1)

    tensors = {
        "token_embd.weight": sd["model.embed_tokens.weight"],
        "output_norm.weight": sd["model.norm.weight"],
        "blk.0.ffn_up.weight": (q, GGMLQuantizationType.Q8_0),
        "blk.0.attn_norm.weight": sd["model.layers.0.input_layernorm.weight"].astype(np.float16),
    }
    path = write_gguf(tmp_path / "t.gguf", model.config, tensors, extra_metadata=extra)
    assert_same_as_reader(path)
    meta = read_gguf_header(path).metadata
    assert meta["test.short"] == [1, 2, 3] and meta["test.short_strings"] == ["a", "bc"]
    assert meta["test.long_strings"] == range(LONG_ARRAY + 5)
    assert meta["test.flag"] is True and meta["test.f64"] == 0.1


def test_a_file_it_does_not_walk_goes_to_gguf_reader(tmp_path: Path) -> None:
    model = make_hf_model("llama")
    norm = model.model.norm.weight.detach().float().numpy()

    def nested(writer) -> None:  # an array of arrays: valid GGUF, not walked here
        writer.add_key_value(
            "test.nested", [[1, 2], [3, 4]], GGUFValueType.ARRAY, sub_type=GGUFValueType.ARRAY
        )

    path = write_gguf(
        tmp_path / "n.gguf", model.config, {"output_norm.weight": norm}, extra_metadata=nested
    )
    with pytest.raises(UnsupportedHeader):
        read_gguf_header(path)
    opened = open_gguf(path)  # GGUFReader's reading, in the same record
    assert [t.name for t in opened.tensors] == ["output_norm.weight"]
    assert np.array_equal(opened.tensors[0].data, norm)


def test_not_a_gguf_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_header(path)
