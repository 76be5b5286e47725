"""A GGUF file cut short (a download stopped, a copy still being written) or corrupted is a
ValueError naming the file, saying it is truncated or corrupt, with the bytes it needs and the
bytes it has: never a struct.error or a failed reshape. Where each part of the file lies is
read with gguf.GGUFReader on the whole file, not with the code under test."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from conftest import make_gguf_checkpoint, make_hf_model, run_cli, write_gguf
from gguf import GGUFReader, GGUFValueType

from kvserve.models.gguf_checkpoint import open_gguf
from kvserve.models.gguf_header import read_gguf_header
from kvserve.models.loader import load_model

_NEEDS = re.compile(
    r"needs at least ([\d,]+) bytes, but the file has ([\d,]+) \(([\d,]+) missing\)"
)


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return make_gguf_checkpoint(path, make_hf_model("llama"))


def cut(whole: Path, tmp_path: Path, size: int) -> Path:
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole.read_bytes()[:size])
    return path


def numbers(message: str) -> tuple[int, int, int]:
    m = _NEEDS.search(message)
    assert m, message
    needed, has, missing = (int(g.replace(",", "")) for g in m.groups())
    return needed, has, missing


def layout(whole: Path) -> dict[str, int]:
    """Byte positions of the file's parts, as gguf's own reader places them."""
    reader = GGUFReader(whole)
    keys = [f for name, f in reader.fields.items() if not name.startswith("GGUF.")]
    last = max(reader.tensors, key=lambda t: t.data_offset + t.n_bytes)
    return {
        "metadata": keys[len(keys) // 2].offset,  # a key in the middle of the metadata
        "tensor_info": reader.tensors[1].field.offset,  # the second tensor's table entry
        "data": min(t.data_offset for t in reader.tensors),
        "last": last.data_offset,
        "data_end": last.data_offset + int(last.n_bytes),
    }


@pytest.mark.parametrize("where", ["fixed", "metadata", "tensor_info"])
def test_a_header_cut_short_names_the_file_and_both_sizes(
    whole: Path, tmp_path: Path, where: str
) -> None:
    at = {"fixed": 17, **layout(whole)}[where] + (0 if where == "fixed" else 5)
    path = cut(whole, tmp_path, at)
    with pytest.raises(ValueError) as e:
        open_gguf(path)
    message = str(e.value)
    assert message.startswith(f"{path} is truncated or corrupt: ")
    needed, has, missing = numbers(message)
    assert has == at and needed > at and missing == needed - at
    assert needed <= whole.stat().st_size  # the header's own bytes, not more


@pytest.mark.parametrize("where", ["data", "last", "one_short"])
def test_tensor_data_cut_short_says_the_exact_size_the_table_needs(
    whole: Path, tmp_path: Path, where: str
) -> None:
    parts = layout(whole)
    at = {
        "data": parts["data"],  # the header whole, every tensor's data missing
        "last": parts["last"] + 7,  # in the middle of the last tensor
        "one_short": parts["data_end"] - 1,
    }[where]
    path = cut(whole, tmp_path, at)
    with pytest.raises(ValueError) as e:
        read_gguf_header(path)
    message = str(e.value)
    assert message.startswith(f"{path} is truncated or corrupt: its tensor data (")
    assert numbers(message) == (parts["data_end"], at, parts["data_end"] - at)


def test_the_whole_file_and_a_cut_in_its_last_padding_still_load(
    whole: Path, tmp_path: Path
) -> None:
    parts = layout(whole)
    reader = GGUFReader(whole)
    for size in (whole.stat().st_size, parts["data_end"]):
        tensors = read_gguf_header(cut(whole, tmp_path, size)).tensors
        assert [t.name for t in tensors] == [t.name for t in reader.tensors]
        assert np.array_equal(tensors[-1].data, reader.tensors[-1].data)


def test_empty_and_tiny_files(whole: Path, tmp_path: Path) -> None:
    for size in (0, 2, 23):
        path = cut(whole, tmp_path, size)
        with pytest.raises(ValueError) as e:
            read_gguf_header(path)
        assert str(e.value) == (
            f"{path} is truncated or corrupt: a GGUF header needs at least 24 bytes, but the "
            f"file has {size} ({24 - size} missing); download or convert it again"
        )


def test_a_corrupt_tensor_type_names_the_tensor(whole: Path, tmp_path: Path) -> None:
    reader = GGUFReader(whole)
    first = reader.tensors[0]
    # the entry is: name length, name, n_dims, dims, ggml type (uint32), offset
    type_at = int(first.field.offset) + 8 + len(first.name) + 4 + 8 * len(first.shape)
    data = bytearray(whole.read_bytes())
    data[type_at : type_at + 4] = (999).to_bytes(4, "little")
    path = tmp_path / "bad-type.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError) as e:
        read_gguf_header(path)
    assert str(e.value) == (
        f"{path} is corrupt: tensor {first.name!r} has ggml type 999, which gguf does not know"
    )


def test_load_model_and_the_cli_give_the_message_not_a_traceback(
    whole: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    parts = layout(whole)
    path = cut(whole, tmp_path, parts["last"] + 7)
    with pytest.raises(ValueError, match="is truncated or corrupt: its tensor data"):
        load_model(path)
    code, _, err = run_cli(capsys, "generate", "--model", str(path), "--prompt", "Hi")
    assert code == 2
    assert err.startswith(f"error: {path} is truncated or corrupt: its tensor data (")
    assert "Traceback" not in err


def test_a_cut_file_gguf_reader_reads_is_named_truncated_too(tmp_path: Path) -> None:
    """Files the fast walk leaves to GGUFReader (here: nested metadata arrays)."""
    model = make_hf_model("llama")
    norm = model.model.norm.weight.detach().float().numpy()

    def nested(writer) -> None:
        writer.add_key_value(
            "test.nested", [[1, 2], [3, 4]], GGUFValueType.ARRAY, sub_type=GGUFValueType.ARRAY
        )

    tensors = {"output_norm.weight": norm}
    whole = write_gguf(tmp_path / "n.gguf", model.config, tensors, extra_metadata=nested)
    data_at = GGUFReader(whole).tensors[0].data_offset
    path = cut(whole, tmp_path, data_at + 10)
    with pytest.raises(ValueError) as e:
        open_gguf(path)
    assert str(e.value).startswith(
        f"{path} is truncated or corrupt ({data_at + 10:,} bytes): gguf's reader failed on it: "
    )
