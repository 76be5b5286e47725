"""SamplingParams: vLLM's defaults, the accepted bounds, bad values rejected with an error
naming the parameter, and immutability. Sampling itself is tested in test_sampling.py."""

from __future__ import annotations

import math

import pytest

from kvserve.sampling import SamplingParams


def test_defaults_follow_vllm() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1.0, 1.0, 0, 0.0)
    assert p.seed is None and p.stop == () and p.stop_token_ids == () and p.logprobs is None
    assert not p.greedy and not p.ignore_eos


def test_stop_is_normalised_to_tuples() -> None:
    p = SamplingParams(stop="###", stop_token_ids=[5, 6])
    assert p.stop == ("###",) and p.stop_token_ids == (5, 6)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 1},
        {"temperature": 0},
        {"temperature": 1e6},
        {"top_p": 1},
        {"top_p": 1e-12},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 10**6},
        {"min_p": 0},
        {"min_p": 1.0},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"logprobs": 0},
        {"logprobs": 20},
        {"stop_token_ids": [0]},
    ],
    ids=repr,
)
def test_accepts_the_bounds(kwargs: dict) -> None:
    params = SamplingParams(**kwargs)
    # each bound is kept as given (sequences as tuples), not clamped or replaced
    for name, value in kwargs.items():
        want = tuple(value) if isinstance(value, list) else value
        assert getattr(params, name) == want, name


BAD_PARAMS = [
    ("max_tokens", 0, ValueError),
    ("max_tokens", -5, ValueError),
    ("max_tokens", 1.5, TypeError),
    ("max_tokens", "16", TypeError),
    ("max_tokens", True, TypeError),
    ("max_tokens", None, TypeError),
    ("temperature", -1, ValueError),
    ("temperature", -1e-9, ValueError),
    ("temperature", math.nan, ValueError),
    ("temperature", math.inf, ValueError),
    ("temperature", "0.7", TypeError),
    ("temperature", True, TypeError),
    ("top_p", 0, ValueError),
    ("top_p", 0.0, ValueError),
    ("top_p", 1.5, ValueError),
    ("top_p", -0.1, ValueError),
    ("top_p", math.nan, ValueError),
    ("top_p", False, TypeError),
    ("top_k", -2, ValueError),
    ("top_k", 2.0, TypeError),
    ("top_k", True, TypeError),
    ("min_p", 1.5, ValueError),
    ("min_p", -0.1, ValueError),
    ("min_p", math.nan, ValueError),
    ("min_p", "0.1", TypeError),
    ("seed", -1, ValueError),
    ("seed", 2**63, ValueError),
    ("seed", 1.0, TypeError),
    ("seed", True, TypeError),
    ("logprobs", 21, ValueError),
    ("logprobs", -1, ValueError),
    ("logprobs", 2.0, TypeError),
    ("logprobs", True, TypeError),
    ("stop", "", ValueError),
    ("stop", ["ok", ""], ValueError),
    ("stop", [3], (ValueError, TypeError)),
    ("stop_token_ids", [-1], ValueError),
    ("stop_token_ids", [1, 2.0], TypeError),
    ("stop_token_ids", [True], TypeError),
]


@pytest.mark.parametrize(
    ("name", "value", "error"), BAD_PARAMS, ids=[f"{n}={v!r}" for n, v, _ in BAD_PARAMS]
)
def test_rejects_bad_values_naming_the_parameter(name: str, value: object, error: type) -> None:
    with pytest.raises(error) as info:
        SamplingParams(**{name: value})
    assert name in str(info.value)


# stop / stop_token_ids that are not iterables must be refused with a message naming them
@pytest.mark.parametrize(("name", "value"), [("stop_token_ids", 5), ("stop", None)])
def test_non_iterable_stop_names_the_parameter(name: str, value: object) -> None:
    with pytest.raises((ValueError, TypeError)) as info:
        SamplingParams(**{name: value})
    assert name in str(info.value)


def test_params_are_frozen() -> None:
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.temperature = 0.0  # type: ignore[misc]
