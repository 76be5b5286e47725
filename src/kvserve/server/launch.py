"""Start the server: bind first, load the model in the background, then serve; stop in order.

/health answers 503 until the model is loaded and the engine loop runs. A model that fails to
load stops the server with that error.

SIGTERM and SIGINT run one orderly shutdown: new connections are refused at once, in-flight
requests get ``--shutdown-timeout`` seconds to finish and are then aborted, the engine loop
stops, the prefix cache is saved, KV events close, and the process exits 0. (uvicorn, left to
itself, re-raises a SIGTERM after its own shutdown, which kills the process before any of that
cleanup; systemd, Docker and Kubernetes all stop services with SIGTERM.) A second signal skips
the grace period.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvicorn

from kvserve.cache_fingerprint import cache_fingerprint
from kvserve.config import EngineConfig
from kvserve.default_model import default_model_path
from kvserve.engine.engine import LLMEngine
from kvserve.engine.faults import FaultInjector
from kvserve.models.architectures import hf_architectures
from kvserve.models.model_session import ModelSession
from kvserve.server.app import build_app, new_state
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.config import ServerConfig
from kvserve.server.connections import uvicorn_options
from kvserve.server.engine_records import WorkerInfo
from kvserve.server.metrics import ServerMetrics
from kvserve.server.prefix_cache_dir import PrefixCacheDir
from kvserve.server.serving import Served

logger = logging.getLogger(__name__)


def default_model_name(model: str | None) -> str:
    """The checkpoint's file stem (GGUF) or directory name (HF), as clients will name it."""
    path = Path(model) if model is not None else default_model_path()
    return path.stem if path.suffix == ".gguf" else path.resolve().name


def load_served(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    model_name: str,
    metrics: ServerMetrics,
    faults: FaultInjector | None = None,
) -> Served:
    """Load the model, build the engine and start its loop thread. ``faults``: tests only,
    model steps that raise (engine/faults.py)."""
    session = ModelSession.open(
        engine_config.model,
        engine_config.dtype,
        engine_config.device,
        quantization=engine_config.quantization,
    )
    cache = engine_config.cache
    if server_config.kv_events is not None:
        cache = dataclasses.replace(cache, enable_kv_cache_events=True)
    engine = LLMEngine.from_session(
        session,
        cache,
        engine_config.scheduler,
        engine_config.enforce_eager,
        faults,
        engine_config.compile_mode,
        engine_config.batch_invariant,
    )
    # stops a background compile: the process must not exit while the compiler runs
    closers: list[Callable[[], None]] = [engine.close]
    publish = None
    cache_dir = None
    if server_config.prefix_cache_dir is not None:
        fingerprint = cache_fingerprint(session, engine.spec, engine_config.quantization)
        cache_dir = PrefixCacheDir(Path(server_config.prefix_cache_dir), fingerprint)
        # with KV events on, the restored blocks go out as BlockStored in the loop's first batch
        cache_dir.load(engine)
    if server_config.kv_events is not None:
        from kvserve.server.kv_events import ZmqEventPublisher  # zmq only when asked for

        publisher = ZmqEventPublisher(server_config.kv_events)
        publish = publisher.publish
        closers.append(publisher.shutdown)
    loop = AsyncEngine(
        engine,
        metrics,
        server_config.max_queued_requests,
        server_config.log_interval_s,
        max_stream_buffer_events=server_config.max_stream_buffer_events,
        health_stall_timeout_s=server_config.health_stall_timeout_s,
        max_consecutive_step_failures=server_config.max_consecutive_step_failures,
        max_restarts=server_config.max_restarts,
        restart_window_s=server_config.restart_window_s,
        publish_kv_events=publish,
    )
    loop.start()
    if cache_dir is not None:
        closers.insert(0, lambda: cache_dir.save_at_shutdown(loop))
    info = WorkerInfo(
        model_path=str(engine_config.model or session.path),
        served_model_name=model_name,
        model_type=session.config.model_type,
        architectures=hf_architectures(session.config.model_type, session.path),
        tokenizer_path=None if session.tokenizer is None else str(session.path),
        dtype=str(session.model.dtype).removeprefix("torch."),
        max_model_len=engine.limits.max_model_len,
        num_kv_blocks=engine.kv_manager.pool.num_blocks,
        block_size=engine.kv_manager.block_size,
        max_num_seqs=engine_config.scheduler.max_num_seqs,
        max_num_batched_tokens=engine_config.scheduler.max_num_batched_tokens,
        scheduling_policy=engine_config.scheduler.scheduling_policy,
        version=importlib.metadata.version("kvserve"),
    )
    return Served(
        engine=loop,
        tokenizer=session.tokenizer,
        model_name=model_name,
        limits=engine.limits,
        bounds=server_config,
        executor=ThreadPoolExecutor(
            server_config.preprocess_threads, thread_name_prefix="kvserve-preprocess"
        ),
        info=info,
        closers=closers,
        prefix_cache_dir=cache_dir,
    )


class _Server(uvicorn.Server):
    """uvicorn's Server, but a SIGTERM/SIGINT it caught is not raised again after ``run()``
    returns: ``run_server``'s cleanup runs and the process exits 0."""

    def handle_exit(self, sig: int, frame: object) -> None:
        if not self.should_exit:
            logger.warning(
                "%s: shutting down (in-flight requests get %.0f s; a second signal skips it)",
                signal.Signals(sig).name,
                self.config.timeout_graceful_shutdown or 0,
            )
        elif not self.force_exit:
            logger.warning("%s again: aborting in-flight requests now", signal.Signals(sig).name)
        was_exiting = self.should_exit
        super().handle_exit(sig, frame)  # type: ignore[arg-type]
        self.force_exit = self.force_exit or was_exiting  # uvicorn forces on SIGINT only
        self._captured_signals.clear()


def run_server(
    engine_config: EngineConfig, server_config: ServerConfig, faults: FaultInjector | None = None
) -> None:
    name = server_config.served_model_name or default_model_name(engine_config.model)
    state = new_state(server_config, name)
    app = build_app(state)
    server = _Server(
        uvicorn.Config(
            app,
            host=server_config.host,
            port=server_config.port,
            log_config=None,  # the CLI configured logging; uvicorn's loggers propagate to it
            timeout_graceful_shutdown=server_config.shutdown_timeout_s,
            **uvicorn_options(server_config),  # header timeout, connection cap (connections.py)
        )
    )
    failure: list[BaseException] = []

    def load() -> None:
        try:
            state.served = load_served(engine_config, server_config, name, state.metrics, faults)
            logger.info("serving %s at http://%s:%d", name, server_config.host, server_config.port)
        except BaseException as e:  # noqa: BLE001 - reported by run_server after the shutdown
            failure.append(e)
            logger.error("could not load the model: %s", e)
            server.should_exit = True

    threading.Thread(target=load, name="kvserve-load", daemon=True).start()
    try:
        server.run()
    finally:
        # uvicorn has answered or cancelled every request by now; stop the loop, then the
        # closers (prefix-cache save, KV events)
        if state.served is not None:
            state.served.close()
        state.body_check_pool.shutdown(wait=True, cancel_futures=True)
    if failure:
        raise failure[0]
    logger.info("server stopped")
