"""Helpers for the server tests: a tiny chat checkpoint and a real `kvserve serve` process.

The checkpoint is a tiny random Llama whose vocabulary is the default model's (49152), saved
with that model's tokenizer and chat template: a complete HF directory that loads in a second
and decodes in a few milliseconds per step, so tests can afford many requests.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
from conftest import make_hf_checkpoint
from prometheus_client.parser import text_string_to_metric_families

from kvserve.default_model import default_model_path
from kvserve.tokenizer import Tokenizer

MAX_MODEL_LEN = 2048  # the tiny model's context
# SGLang's router, a peer in its own venv (scripts/setup_router.sh; CI installs it)
ROUTER_PYTHON = Path(
    os.environ.get(
        "KVSERVE_SGLANG_ROUTER_PYTHON",
        Path(__file__).resolve().parents[1] / ".peers/sglang-router/bin/python",
    )
)


def build_chat_checkpoint(tmp: Path, max_model_len: int = MAX_MODEL_LEN) -> Path:
    tokenizer = Tokenizer.load(default_model_path().parent, default_model_path())
    directory, _ = make_hf_checkpoint(
        tmp,
        "llama",
        name="tiny-chat",
        vocab_size=49152,
        max_position_embeddings=max_model_len,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    tokenizer.hf.save_pretrained(directory)
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    log_path: Path
    api_key: str | None
    model: str = "tiny-chat"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, **kwargs
        )

    def http(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name (labels dropped: one model, one value each)."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.endswith("_bucket") or sample.name.endswith("_created"):
                    continue
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
        return values

    def wait_for(self, name: str, value: float, timeout: float = 60.0) -> dict[str, float]:
        """Poll /metrics until ``name`` reads ``value``; fails with the metrics and log tail."""
        deadline = time.monotonic() + timeout
        while (m := self.metrics())[name] != value:
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} never became {value}: {m}\n{self.log()[-3000:]}")
            time.sleep(0.02)
        return m

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Poll /metrics until nothing runs or waits and no KV block is held."""
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            self.wait_for(name, 0, timeout)
        return self.wait_for("vllm:kv_cache_usage_perc", 0, timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_server(model_dir: Path, log_dir: Path, *args: str, api_key: str | None = None):
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    argv = [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(model_dir)]
    argv += ["--port", str(port), "--served-model-name", "tiny-chat", *args]
    if api_key:
        argv += ["--api-key", api_key]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, log_path, api_key)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{server.log()}")
        try:
            r = httpx.get(f"{server.url}/health", headers=server.headers, timeout=2)
            if r.status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"the server did not become healthy:\n{server.log()}")


def cached_prefix_tokens(a: list[int], b: list[int], block_size: int) -> int:
    """Tokens of b that a prefix cache holding a can serve: the whole blocks of their common
    prefix."""
    common = next(
        (i for i, (s, t) in enumerate(zip(a, b, strict=False)) if s != t), min(len(a), len(b))
    )
    return (common // block_size) * block_size
