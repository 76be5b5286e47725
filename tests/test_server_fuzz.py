"""Fuzz the request schema: schemathesis generates requests from the server's own OpenAPI
document, both valid and deliberately invalid ones, and no response may be a 5xx.

The server runs with --max-model-len 64 so that every valid request (n up to 64, any
max_tokens that fits) finishes quickly on the tiny model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation.modes import GenerationMode
from server_helpers import start_server

API_KEY = "fuzz-key"


@pytest.fixture(scope="module")
def fuzz_server(chat_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    proc = start_server(
        chat_checkpoint, tmp_path_factory.mktemp("fuzz"), "--max-model-len", "64",
        api_key=API_KEY,
    )  # fmt: skip
    yield proc
    proc.stop()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_request_is_a_server_error(fuzz_server, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(
        f"{fuzz_server.url}/openapi.json", headers=fuzz_server.headers
    )

    @given(case=schema.as_strategy(mode))
    @settings(
        max_examples=200,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,  # the same cases every run: CI must not flake on a lucky draw
    )
    def check(case) -> None:
        response = case.call(base_url=fuzz_server.url, headers=fuzz_server.headers, timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (
            f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text}"
        )
        assert response.status_code != 422, response.text  # validation errors are 400s
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}

    seen: dict[int, int] = {}
    check()
    # the fuzzer did reach the handlers: some requests succeeded, or were refused by them
    assert seen.get(200, 0) > 0 if mode is GenerationMode.POSITIVE else seen.get(400, 0) > 0
