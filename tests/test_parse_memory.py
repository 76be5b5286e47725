"""parse_memory: one rule for every spelling. A number without a unit is bytes, whatever its
size or type (it once read "1000000" as 10^6 GiB and "2000000" as 2 MB); below 1 KiB it is
refused as a forgotten unit; units are case-insensitive, KB/MB/GB/TB decimal, KiB/MiB/GiB/TiB
binary."""

from __future__ import annotations

import pytest

from kvserve.config import parse_memory

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize(
    ("spelling", "expected"),
    [
        # no unit: bytes, in every type and size
        ("1000000", 1_000_000),
        ("2000000", 2_000_000),
        (1_000_000, 1_000_000),
        ("1048575", 1_048_575),
        ("1048576", 1_048_576),
        ("1024", 1024),
        (1024, 1024),
        ("1e9", 1_000_000_000),
        (1e9, 1_000_000_000),
        (2.0 * GIB, 2 * GIB),
        (" 4096 ", 4096),
        (2**62 + 1, 2**62 + 1),  # an int stays exact
        # binary units
        ("2GiB", 2 * GIB),
        ("2gib", 2 * GIB),
        ("2 GiB", 2 * GIB),
        ("1.5GiB", 3 * GIB // 2),
        ("512MiB", 512 * MIB),
        ("64KiB", 64 * KIB),
        ("1TiB", 1 << 40),
        # decimal units
        ("80GB", 80 * 10**9),
        ("1.5GB", 1_500_000_000),
        ("512MB", 512 * 10**6),
        ("4KB", 4000),
        ("2TB", 2 * 10**12),
        # bytes spelled out: any size
        ("4B", 4),
        ("4096b", 4096),
    ],
)
def test_spellings(spelling: int | float | str, expected: int) -> None:
    assert parse_memory(spelling) == expected


@pytest.mark.parametrize(
    ("spelling", "message"),
    [
        ("2", "kv_cache_memory '2' has no unit, so it means 2 bytes; write 2GiB or 2MiB (or 2B for bytes)"),
        (2, "kv_cache_memory 2 has no unit, so it means 2 bytes; write 2GiB or 2MiB (or 2B for bytes)"),
        ("1023", "kv_cache_memory '1023' has no unit, so it means 1023 bytes; write 1023GiB or 1023MiB (or 1023B for bytes)"),
        ("1.5", "kv_cache_memory '1.5' is not a whole number of bytes; add a unit: 1.5GiB"),
        (1.5, "kv_cache_memory 1.5 is not a whole number of bytes; add a unit: 1.5GiB"),
        ("0", "kv_cache_memory must be > 0, got '0'"),
        ("-1GiB", "kv_cache_memory must be > 0, got '-1GiB'"),
        ("0.0001B", "kv_cache_memory must be > 0, got '0.0001B'"),
        ("lots", "cannot read kv_cache_memory 'lots'; use bytes or a number with a unit: 2GiB, 512MiB, 80GB, 4096B"),
        ("2 gigs", "cannot read kv_cache_memory '2 gigs'; use bytes or a number with a unit: 2GiB, 512MiB, 80GB, 4096B"),
        ("GiB", "cannot read kv_cache_memory 'GiB'; use bytes or a number with a unit: 2GiB, 512MiB, 80GB, 4096B"),
        ("inf", "kv_cache_memory must be a finite size, got 'inf'"),
        ("nan", "kv_cache_memory must be a finite size, got 'nan'"),
    ],
)  # fmt: skip
def test_refusals_name_the_value(spelling: int | float | str, message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_memory(spelling)
    assert str(e.value) == message


def test_wrong_types_and_the_setting_named() -> None:
    for value in (True, None, [1]):
        with pytest.raises(TypeError, match="must be bytes or a string such as 2GiB"):
            parse_memory(value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^--device-memory '80' has no unit"):
        parse_memory("80", "--device-memory")
