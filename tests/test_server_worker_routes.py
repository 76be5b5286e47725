"""The router-facing worker endpoints (server/worker_routes.py): against real `kvserve serve`
processes, and with SGLang's router itself (sglang-router 0.3.2, a peer in its own venv that
scripts/test.sh installs: .peers/sglang-router) in front of two replicas."""

from __future__ import annotations

import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import (
    MAX_MODEL_LEN,
    ROUTER_PYTHON,
    ServerProcess,
    free_port,
    start_server,
)

from kvserve.config import CacheConfig

KEY = "worker-key"
BLOCKS = 160


@pytest.fixture(scope="module")
def worker(chat_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("worker")
    args = ["--num-kv-blocks", str(BLOCKS), "--dtype", "float32"]
    proc = start_server(chat_checkpoint, tmp, *args, api_key=KEY)
    yield proc
    proc.stop()


def test_server_and_model_info(worker: ServerProcess, chat_checkpoint: Path) -> None:
    with worker.http() as http:
        info = http.get("/server_info").json()
        assert http.get("/get_server_info").json() == info  # SGLang's older name
        model = http.get("/model_info").json()
        assert http.get("/get_model_info").json() == model
    block = CacheConfig().block_size
    assert info["served_model_name"] == "tiny-chat"
    assert info["model_path"] == str(chat_checkpoint)
    assert info["max_model_len"] == info["context_length"] == MAX_MODEL_LEN
    assert (info["num_kv_blocks"], info["block_size"]) == (BLOCKS, block)
    assert info["max_total_num_tokens"] == BLOCKS * block
    assert info["dtype"] == "float32"
    assert info["scheduling_policy"] == "priority" and info["tp_size"] == info["dp_size"] == 1
    assert info["version"] == importlib.metadata.version("kvserve")
    assert model == {
        "model_path": str(chat_checkpoint),
        "tokenizer_path": str(chat_checkpoint),
        "is_generation": True,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "served_model_name": "tiny-chat",
    }


def test_worker_routes_need_the_key(worker: ServerProcess) -> None:
    for method, path in [
        ("GET", "/server_info"),
        ("GET", "/model_info"),
        ("GET", "/get_load"),
        ("POST", "/flush_cache"),
        ("POST", "/save_cache"),
    ]:
        r = httpx.request(method, f"{worker.url}{path}", timeout=10)
        assert r.status_code == 401, (path, r.text)
    # with the key, a server started without --prefix-cache-dir says what it lacks
    r = worker.http().post("/save_cache")
    assert r.status_code == 400 and "--prefix-cache-dir" in r.json()["error"]["message"]


def complete(worker: ServerProcess, prompt: list[int], max_tokens: int = 1) -> int:
    """Cached prompt tokens of one completion."""
    body = {"model": worker.model, "prompt": prompt, "max_tokens": max_tokens}
    r = worker.http().post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_flush_drops_the_cache_and_spares_running_requests(worker: ServerProcess) -> None:
    block = CacheConfig().block_size
    http = worker.http()
    http.post("/flush_cache")  # whatever earlier tests left
    prompt = list(range(1000, 1000 + 5 * block + 3))  # 5 full blocks
    assert complete(worker, prompt) == 0
    assert complete(worker, prompt) == 5 * block  # a hit
    worker.wait_idle()
    load = http.get("/get_load").json()
    assert load == [
        {
            "dp_rank": 0,
            "num_reqs": 0,
            "num_running_reqs": 0,
            "num_waiting_reqs": 0,
            "num_tokens": 0,
            "kv_cache_usage": 0.0,
        }
    ]
    r = http.post("/flush_cache")
    assert r.status_code == 200
    assert r.json()["success"] is True and r.json()["num_blocks_freed"] == 5
    assert complete(worker, prompt) == 0  # the hit is gone
    assert http.get("/flush_cache").json()["num_blocks_freed"] == 5  # GET too (SGLang's old)

    # a long generation holds its blocks while the cache is flushed around it
    long_prompt = list(range(3000, 3000 + 4 * block))
    for _attempt in range(3):
        if _flush_beside_a_running_request(worker, long_prompt):
            break
    else:
        pytest.fail("the long generation finished before /get_load saw it, three times")
    worker.wait_idle()


def _flush_beside_a_running_request(worker: ServerProcess, long_prompt: list[int]) -> bool:
    """Checks the flush while a stream runs; False when the stream had already finished by
    the time /get_load was asked (the tiny model writes ~700 tokens/s: a test process
    descheduled for seconds on a loaded 2-core CI machine misses it), so the caller retries."""
    http = worker.http()
    block = CacheConfig().block_size
    max_tokens = MAX_MODEL_LEN - len(long_prompt)  # as long as the context allows
    with httpx.Client(base_url=worker.url, headers=worker.headers, timeout=60) as c:
        body = {"model": worker.model, "prompt": long_prompt, "max_tokens": max_tokens}
        body |= {"stream": True, "ignore_eos": True}
        with c.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            while not next(lines).startswith("data: {"):
                pass  # its prompt is computed: its 4 blocks are registered and held
            load = http.get("/get_load").json()[0]
            if load["num_running_reqs"] == 0:
                rest = [line for line in lines if line]
                assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in "".join(rest)
                worker.wait_idle()
                return False
            assert load["num_running_reqs"] == 1 and load["num_tokens"] >= 4 * block
            assert http.post("/flush_cache").json()["num_blocks_freed"] == 0  # held: kept
            body_2 = {"model": worker.model, "prompt": long_prompt + [7], "max_tokens": 1}
            cached = http.post("/v1/completions", json=body_2).json()["usage"]
            assert cached["prompt_tokens_details"]["cached_tokens"] == 4 * block
            # leaving the stream aborts the generation
    return True


# -- SGLang's router in front of two replicas ----------------------------------------------------


def start_router(workers: list[ServerProcess], log: Path) -> tuple[str, subprocess.Popen]:
    if not ROUTER_PYTHON.exists():
        msg = f"sglang-router is not installed at {ROUTER_PYTHON} (scripts/setup_router.sh)"
        if os.environ.get("CI"):
            pytest.fail(msg)  # CI installs it: its absence is a failure, not a skip
        pytest.skip(msg)
    port = free_port()
    argv = [str(ROUTER_PYTHON), "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--policy", "cache_aware", "--api-key", KEY]
    argv += ["--health-check-interval-secs", "1", "--prometheus-port", str(free_port())]
    argv += ["--worker-urls", *[w.url for w in workers]]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            models = httpx.get(f"{url}/v1/models", headers=auth(), timeout=2)
            if models.status_code == 200 and models.json().get("data"):
                return url, proc
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError(f"the router never listed a model:\n{log.read_text()[-3000:]}")


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_sglang_router_registers_the_model_and_routes_by_prefix(
    chat_checkpoint: Path, tmp_path: Path
) -> None:
    workers = [start_server(chat_checkpoint, tmp_path, api_key=KEY) for _ in range(2)]
    router = None
    try:
        url, router = start_router(workers, tmp_path / "router.log")
        models = httpx.get(f"{url}/v1/models", headers=auth(), timeout=10).json()
        # registered under the served name (from /server_info), not "unknown"
        assert [m["id"] for m in models["data"]] == ["tiny-chat"]
        block = CacheConfig().block_size
        system = "You are a careful assistant. " + " ".join(f"rule{i}" for i in range(60))
        cached = []
        with httpx.Client(base_url=url, headers=auth(), timeout=60) as c:
            for i in range(6):
                # routed by the model name the router learnt from /server_info
                body = {"model": "tiny-chat", "prompt": f"{system} question {i}:"}
                body["max_tokens"] = 1
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        # cache_aware keeps a shared prefix on one replica: after the first, every request
        # hits; one replica holds all of them (its prompt-token counter says so)
        assert cached[0] == 0 and all(n >= 8 * block for n in cached[1:]), cached
        served = [w.metrics()["vllm:prompt_tokens_total"] for w in workers]
        assert sorted(served)[0] == 0, served
    finally:
        if router is not None:
            router.terminate()
            try:
                router.wait(timeout=30)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait()
        for w in workers:
            w.stop()


# -- kvserve cluster -----------------------------------------------------------------------------


def test_cluster_serves_through_the_router_and_survives_a_killed_replica(
    chat_checkpoint: Path, tmp_path: Path
) -> None:
    """`kvserve cluster --replicas 2`: the router registers both; the replica that holds the
    shared prefix is killed mid-run and every request still succeeds (the router's retries and
    health checks move them to the other); SIGTERM stops the whole set."""
    if not ROUTER_PYTHON.exists() and not os.environ.get("CI"):
        pytest.skip(f"sglang-router is not installed at {ROUTER_PYTHON}")
    port = free_port()
    serve = f"--model {chat_checkpoint} --served-model-name tiny-chat --dtype float32"
    argv = [sys.executable, "-m", "kvserve.cli", "cluster", "--replicas", "2"]
    argv += ["--port", str(port), "--router-python", str(ROUTER_PYTHON), "--serve-args", serve]
    argv += ["--log-dir", str(tmp_path)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("kvserve cluster: logs in"):
                break
        assert proc.poll() is None, "".join(lines)
        found = [
            re.fullmatch(r"kvserve cluster: (replica-\d) (\S+) \(pid (\d+)\)", ln.strip())
            for ln in lines
        ]
        pids = {m[1]: int(m[3]) for m in found if m}
        urls = [m[2] for m in found if m]
        assert len(pids) == 2 and len(urls) == 2, "".join(lines)
        url = f"http://127.0.0.1:{port}"
        system = "Shared instructions. " + " ".join(f"item{i}" for i in range(40))

        def ask(c: httpx.Client, i: int) -> None:
            body = {"model": "tiny-chat", "prompt": f"{system} q{i}", "max_tokens": 2}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, (i, r.status_code, r.text)

        with httpx.Client(base_url=url, timeout=60) as c:
            for i in range(4):
                ask(c, i)
            served = [_prompt_tokens(u) for u in urls]
            busy = max(range(2), key=lambda j: served[j])
            os.kill(pids[f"replica-{busy}"], signal.SIGKILL)  # the one holding the prefix
            for i in range(4, 12):
                ask(c, i)
            assert _prompt_tokens(urls[1 - busy]) > 0  # the survivor served them
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        for pid in pids.values():
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:  # a failed test: stop the set as a user would, then make sure
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()  # its replicas and router get SIGTERM from the kernel (PDEATHSIG)
                proc.wait()


def test_cluster_members_die_with_a_killed_cluster(chat_checkpoint: Path, tmp_path: Path) -> None:
    """A cluster process killed with SIGKILL runs no cleanup; its replicas and router still
    go (each was started with PR_SET_PDEATHSIG)."""
    if not ROUTER_PYTHON.exists() and not os.environ.get("CI"):
        pytest.skip(f"sglang-router is not installed at {ROUTER_PYTHON}")
    serve = f"--model {chat_checkpoint} --served-model-name tiny-chat --dtype float32"
    argv = [sys.executable, "-m", "kvserve.cli", "cluster", "--replicas", "1"]
    argv += ["--port", str(free_port()), "--router-python", str(ROUTER_PYTHON)]
    argv += ["--serve-args", serve, "--log-dir", str(tmp_path)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    pids = []
    try:
        for line in proc.stdout:
            if line.startswith("kvserve cluster: ") and (m := re.search(r"\(pid (\d+)\)", line)):
                pids.append(int(m[1]))
            if line.startswith("kvserve cluster: logs in"):
                break
        assert len(pids) == 2, pids  # the router and one replica
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 30
    for pid in pids:
        while _alive(pid):
            assert time.monotonic() < deadline, f"pid {pid} outlived its cluster"
            time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by init) counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


def _prompt_tokens(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:prompt_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no vllm:prompt_tokens_total at {url}")
