"""The command line with the default model, in process (``kvserve.cli.main`` with capsys) and
once as a real process (``python -m kvserve.cli``).

Loading the default model costs seconds, so in-process calls share one loaded session:
``ModelSession.open`` is wrapped to load each (model, dtype, device) once for this module.
Usage errors rejected before any model is loaded, missing model paths and the console script
are tested in test_cli_no_model.py.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
from conftest import _env, run_cli

from kvserve import cli
from kvserve.models.model_session import ModelSession

# A small paged KV cache (32 blocks of 16 = 512 tokens) instead of the 1 GiB default: plenty for
# one request, and cheap to allocate on every in-process call. The subprocess test keeps the
# defaults.
SMALL_CACHE = ("--num-kv-blocks", "32")
PROMPT = "The capital of France is"  # greedy: " Paris.\n\nThe answer is ..."
# README's documented keys, plus num_cached_tokens (prompt tokens served from the prefix
# cache; 0 with --no-cache) that the engine-backed generate added.
BASE_KEYS = {
    "num_cached_tokens",
    "token_ids",
    "text",
    "prompt_tokens",
    "completion_tokens",
    "finish_reason",
    "kv_projections",
    "ttft_s",
    "decode_s",
    "tokens_per_s",
}
VERIFY_KEYS = {
    "prompt_tokens",
    "generated_tokens",
    "same_tokens",
    "first_divergence",
    "max_abs_logit_diff",
    "bitwise_equal",
    "kv_projections_no_cache",
    "kv_projections_cached",
    "wall_s_no_cache",
    "wall_s_cached",
    "cache_bytes",
    "projection_ratio",
    "speedup",
}


@pytest.fixture(scope="module", autouse=True)
def shared_session() -> Iterator[dict]:
    """Load the default model once for every in-process ``main()`` call of this module."""
    real_open = ModelSession.open
    sessions: dict = {}
    loads = {"count": 0}

    def open_once(model=None, dtype="auto", device=None, show_progress=False, quantization=None):
        if model is not None:  # explicit paths (error cases) take the real path every time
            return real_open(model, dtype, device, show_progress, quantization)
        key = (dtype, device, quantization)
        if key not in sessions:
            loads["count"] += 1
            sessions[key] = real_open(None, dtype, device, False, quantization)
        return sessions[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ModelSession, "open", open_once)
        yield loads


def run_json(capsys: pytest.CaptureFixture, *argv: str) -> dict:
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out  # exactly one JSON object, nothing streamed
    return json.loads(lines[0])


@pytest.fixture(scope="module")
def greedy_64_cached() -> dict:
    """``generate --json`` greedy, 64 tokens, with the cache and --logprobs 3 (shared)."""
    capture = io.StringIO()
    old = sys.stdout
    sys.stdout = capture
    try:
        code = cli.main(
            [
                "generate",
                "--json",
                "--temperature",
                "0",
                "--max-tokens",
                "64",
                "--ignore-eos",
                "--prompt",
                PROMPT,
                "--logprobs",
                "3",
                # float32: the exactness contract (in bfloat16 the cached step and a no-cache
                # prefill take different matmul paths and may round apart)
                "--dtype",
                "float32",
                *SMALL_CACHE,
            ]
        )
    finally:
        sys.stdout = old
    assert code == 0
    return json.loads(capture.getvalue().strip().splitlines()[-1])


def check_common_fields(out: dict, max_tokens: int) -> None:
    assert isinstance(out["text"], str)
    assert out["completion_tokens"] == len(out["token_ids"]) <= max_tokens
    assert all(isinstance(t, int) and 0 <= t < 49152 for t in out["token_ids"])
    assert out["finish_reason"] in ("stop", "length")
    # the rate is the tokens over the measured decode time (timings are not asserted)
    assert out["ttft_s"] > 0 and out["decode_s"] > 0
    total = out["ttft_s"] + out["decode_s"]
    assert out["tokens_per_s"] == pytest.approx(out["completion_tokens"] / total)
    assert 0 <= out["num_cached_tokens"] < out["prompt_tokens"]


def test_generate_json_cached_keys_and_logprobs(greedy_64_cached: dict) -> None:
    out = greedy_64_cached
    assert set(out) == BASE_KEYS | {"logprobs"}
    check_common_fields(out, 64)
    assert out["prompt_tokens"] == 5
    assert out["completion_tokens"] == 64 and out["finish_reason"] == "length"
    assert out["kv_projections"] == 5 + 64 - 1
    assert out["text"].startswith(" Paris")
    logprobs = out["logprobs"]
    assert isinstance(logprobs, list) and len(logprobs) == 64
    for token, step in zip(out["token_ids"], logprobs, strict=True):
        assert isinstance(step, dict) and len(step) == 3
        assert all(isinstance(k, str) and k.isdigit() for k in step)
        assert all(isinstance(v, float) and v <= 0.0 for v in step.values())
        assert list(step.values()) == sorted(step.values(), reverse=True)
        # greedy: the chosen token is the most likely one
        assert max(step, key=step.get) == str(token)


@pytest.mark.slow  # the O(n^2) no-cache decoder over 64 tokens
def test_generate_no_cache_gives_the_same_tokens(capsys, greedy_64_cached: dict) -> None:
    """Acceptance: 64 greedy tokens with and without --no-cache are identical."""
    out = run_json(
        capsys,
        "generate",
        "--json",
        "--temperature",
        "0",
        "--max-tokens",
        "64",
        "--ignore-eos",
        "--dtype",
        "float32",
        "--prompt",
        PROMPT,
        "--no-cache",
    )
    assert set(out) == BASE_KEYS  # no --logprobs: no logprobs key
    check_common_fields(out, 64)
    assert out["token_ids"] == greedy_64_cached["token_ids"]
    assert out["text"] == greedy_64_cached["text"]
    assert out["kv_projections"] == sum(range(5, 5 + 64))
    assert out["num_cached_tokens"] == 0


def test_generate_prompt_ids(capsys) -> None:
    sampling = ["--max-tokens", "4", *SMALL_CACHE, "--temperature", "0.8", "--seed", "5"]
    sampling += ["--top-k", "40", "--top-p", "0.9", "--min-p", "0.05"]
    out = run_json(capsys, "generate", "--json", "--prompt-ids", "1, 2,3", *sampling)
    assert set(out) == BASE_KEYS
    check_common_fields(out, 4)
    assert out["prompt_tokens"] == 3
    again = run_json(capsys, "generate", "--json", "--prompt-ids", "1,2,3", *sampling)
    assert again["token_ids"] == out["token_ids"]  # seeded


def test_generate_stop_string_cuts_the_text(capsys) -> None:
    out = run_json(
        capsys,
        "generate",
        "--json",
        "--temperature",
        "0",
        "--max-tokens",
        "16",
        "--prompt",
        PROMPT,
        "--stop",
        ".",
        "--stop",
        "never-there",
        *SMALL_CACHE,
    )
    assert out["text"] == " Paris"
    assert out["finish_reason"] == "stop"
    assert out["completion_tokens"] < 16


def test_generate_streams_text_and_reports_on_stderr(capsys) -> None:
    code, out, err = run_cli(
        capsys,
        "generate",
        "--temperature",
        "0",
        "--max-tokens",
        "16",
        "--prompt",
        PROMPT,
        "--stop",
        ".",
        *SMALL_CACHE,
    )
    assert code == 0
    assert out == " Paris\n"
    assert "finish=stop" in err and "5 prompt" in err


def test_chat_reuses_the_cache_across_turns(capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi!\nWhat is 2+2?\n"))
    code, out, err = run_cli(
        capsys,
        "chat",
        "--temperature",
        "0",
        "--max-tokens",
        "6",
        "--verbose",
        "--max-model-len",
        "512",
        *SMALL_CACHE,
    )
    assert code == 0
    reused = [int(n) for n in re.findall(r"tokens: (\d+) reused from the cache", err)]
    assert len(reused) == 2
    assert reused[0] == 0 and reused[1] > 0
    assert out.count("> ") >= 2  # input() prompts; the replies are streamed after them


def test_verify_json(capsys) -> None:
    # float32: the exactness claim (and 4-byte cache rows); auto may pick bfloat16
    code, out, err = run_cli(capsys, "verify", "--json", "--max-tokens", "8", "--dtype", "float32")
    assert code == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert set(report) == VERIFY_KEYS
    assert report["same_tokens"] is True and report["first_divergence"] is None
    assert report["generated_tokens"] == 8
    p = report["prompt_tokens"]
    assert report["kv_projections_no_cache"] == sum(range(p, p + 8))
    assert report["kv_projections_cached"] == p + 8 - 1
    assert 0 <= report["max_abs_logit_diff"] < 1e-3
    assert report["bitwise_equal"] is (report["max_abs_logit_diff"] == 0.0)
    assert report["cache_bytes"] == 2 * 30 * 3 * 64 * (p + 8) * 4
    assert report["projection_ratio"] > 1


def test_verify_text_report(capsys) -> None:
    code, out, _ = run_cli(capsys, "verify", "--max-tokens", "2", "--prompt", "Hello")
    assert code == 0
    assert "same tokens:              yes" in out
    assert "K/V projections:" in out and "cache size:" in out


BAD_VALUES = [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "2"], "top_p"),
    (["--top-p", "0"], "top_p"),
    (["--top-k", "-2"], "top_k"),
    (["--min-p", "1.5"], "min_p"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--seed", "-1"], "seed"),
    (["--logprobs", "21"], "logprobs"),
    (["--stop", ""], "stop"),
    (["--max-tokens", "9000"], "maximum context length is 8192 tokens, but 9002"),
]


@pytest.mark.parametrize(("args", "named"), BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_bad_sampling_values_exit_2(capsys, args: list[str], named: str) -> None:
    code, out, err = run_cli(capsys, "generate", "--json", "--prompt-ids", "1,2", *args)
    assert code == 2
    assert err.startswith("error: ") and named in err
    assert out == ""


@pytest.mark.parametrize(
    ("ids", "named"),
    [
        ("a,b", "--prompt-ids"),
        ("1,2.5", "--prompt-ids"),
        ("999999", "999999"),
        ("-1", "-1"),
        (",", "empty"),
    ],
)
def test_bad_prompt_ids_exit_2(capsys, ids: str, named: str) -> None:
    code, out, err = run_cli(capsys, "generate", "--json", "--prompt-ids", ids, "--max-tokens", "2")
    assert code == 2
    assert err.startswith("error: ") and named in err
    assert out == ""


def test_verify_bad_max_tokens_exit_2(capsys) -> None:
    code, _, err = run_cli(capsys, "verify", "--max-tokens", "0")
    assert code == 2 and "max_tokens" in err


def test_in_process_calls_loaded_the_model_once(shared_session: dict) -> None:
    # once per dtype asked for: the default (auto) and verify's explicit float32 (the same
    # session when auto is float32 on this CPU is still loaded under its own key)
    assert shared_session["count"] <= 2


# --------------------------------------------------------------------------------------------
# a real process: the module entry point


@pytest.mark.slow  # a fresh interpreter loads the model
def test_python_m_kvserve_cli_generate(greedy_64_cached: dict) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvserve.cli",
            "generate",
            "--json",
            "--temperature",
            "0",
            "--max-tokens",
            "4",
            "--ignore-eos",
            "--prompt",
            PROMPT,
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out) == BASE_KEYS
    assert out["token_ids"] == greedy_64_cached["token_ids"][:4]
