"""The command line where no model gets loaded: bad flags rejected before loading, missing
model paths (through the real loader), argparse usage errors, and the installed console script
run as a real process. Runs with the default model are in test_cli.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import _env, run_cli

from kvserve import cli


def test_flags_are_checked_before_the_model_is_loaded(capsys, tmp_path: Path) -> None:
    missing = str(tmp_path / "never-loaded")
    code, _, err = run_cli(
        capsys, "generate", "--model", missing, "--prompt", "hi", "--temperature", "-1"
    )
    assert code == 2 and "temperature" in err and missing not in err


def test_missing_model_path_exit_2(capsys, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    code, out, err = run_cli(capsys, "generate", "--model", str(missing), "--prompt", "hi")
    assert code == 2 and out == ""
    assert "does not exist" in err and str(missing) in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_cli(capsys, "verify", "--model", str(empty))
    assert code == 2 and "config.json" in err


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["generate"],  # needs --prompt or --prompt-ids
        ["generate", "--prompt", "a", "--prompt-ids", "1"],
        ["generate", "--prompt", "a", "--temperature", "warm"],
        ["generate", "--prompt", "a", "--dtype", "int8"],
        ["frobnicate"],
        ["serve", "--port", "eighty"],
    ],
    ids=[
        "no-command",
        "no-prompt",
        "both-prompts",
        "non-number",
        "bad-dtype",
        "unknown-command",
        "serve-bad-port",
    ],
)
def test_argparse_errors_exit_2(capsys, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_console_script_entry_point() -> None:
    script = Path(sys.executable).with_name("kvserve")
    if not script.exists():
        pytest.skip("kvserve console script not installed next to this interpreter")
    proc = subprocess.run(
        [str(script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    for command in ("generate", "chat", "verify"):
        assert command in proc.stdout
    proc = subprocess.run(
        [str(script), "generate", "--prompt-ids", "1", "--model", "/nonexistent/m"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        check=False,
    )
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    assert proc.stdout == ""


def test_serve_defaults_to_latency_scheduling_and_generate_to_throughput() -> None:
    from kvserve.cli import build_parser
    from kvserve.cli_args import scheduler_config

    parser = build_parser()
    serve = scheduler_config(parser.parse_args(["serve"]))
    assert (serve.scheduling_policy, serve.max_prefill_tokens_with_decodes) == ("priority", 256)
    gen = scheduler_config(parser.parse_args(["generate", "--prompt", "hi"]))
    assert (gen.scheduling_policy, gen.max_prefill_tokens_with_decodes) == ("fcfs", None)
    # the defaults are overridable both ways
    custom = scheduler_config(
        parser.parse_args(
            ["serve", "--scheduling-policy", "fcfs", "--max-prefill-tokens-with-decodes", "64"]
        )
    )
    assert (custom.scheduling_policy, custom.max_prefill_tokens_with_decodes) == ("fcfs", 64)


def test_cluster_splits_the_cores_among_its_replicas(tmp_path, monkeypatch) -> None:
    from kvserve import cluster
    from kvserve.cli import build_parser

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    parser = build_parser()
    log = ["--log-dir", str(tmp_path)]
    config = cluster.config_from_args(parser.parse_args(["cluster", "--replicas", "3", *log]))
    assert config.threads_per_replica == 2  # 8 cores // 3 replicas
    many = cluster.config_from_args(parser.parse_args(["cluster", "--replicas", "16", *log]))
    assert many.threads_per_replica == 1
    explicit = ["cluster", "--replicas", "3", "--threads-per-replica", "4", *log]
    assert cluster.config_from_args(parser.parse_args(explicit)).threads_per_replica == 4
    with pytest.raises(ValueError, match="threads-per-replica"):
        cluster.config_from_args(parser.parse_args(["cluster", "--threads-per-replica", "0", *log]))
