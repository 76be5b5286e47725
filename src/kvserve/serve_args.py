"""`kvserve serve`'s flags and the ServerConfig built from them (the engine's flags are in
cli_args.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvserve.cli_args import add_engine_args, add_model_args
from kvserve.server.config import KVEventsConfig, ServerConfig
from kvserve.server.tenants import ApiKey, parse_api_keys

_SERVER = ServerConfig()


def add_serve_args(s: argparse.ArgumentParser) -> None:
    add_model_args(s)
    add_engine_args(s, serving=True)
    s.add_argument("--host", default=_SERVER.host)
    s.add_argument("--port", type=int, default=_SERVER.port)
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint; this key is the operator's "
        "(tenant 'default', admin: /flush_cache, /save_cache, every tenant in /v1/kv_state)",
    )
    s.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help="one 'KEY TENANT' or 'KEY TENANT admin' per line: each key's tenant gets a prefix "
        "cache of its own; an admin key may also flush and save every tenant's cache",
    )
    s.add_argument(
        "--served-model-name", default=None, help="the model id clients send (default: file name)"
    )
    s.add_argument(
        "--max-queued-requests",
        type=int,
        default=_SERVER.max_queued_requests,
        help="sequences (n x prompts) waiting to start; beyond it requests get 503 with "
        "Retry-After",
    )
    s.add_argument(
        "--max-body-bytes",
        type=int,
        default=_SERVER.max_body_bytes,
        help="larger request bodies get 413",
    )
    s.add_argument(
        "--log-interval",
        type=float,
        default=_SERVER.log_interval_s,
        help="seconds between the running/waiting/KV usage log lines",
    )
    flags = [
        ("--max-prompts-per-request", int, "max_prompts_per_request", "prompts in one request"),
        (
            "--max-prompt-tokens-per-request",
            int,
            "max_prompt_tokens_per_request",
            "prompt tokens of one request, all prompts together",
        ),
        ("--max-stop-strings", int, "max_stop_strings", "stop strings in one request"),
        ("--max-stop-chars", int, "max_stop_chars", "total length of one request's stop strings"),
        (
            "--default-chat-max-tokens",
            int,
            "default_chat_max_tokens",
            "max_tokens of a chat completion that sends neither max_tokens nor "
            "max_completion_tokens (capped to the context left; /v1/completions' default is 16)",
        ),
        (
            "--max-stream-buffer-events",
            int,
            "max_stream_buffer_events",
            "unread events per sequence after which a stalled stream is aborted",
        ),
        (
            "--stream-stall-timeout-s",
            float,
            "stream_stall_timeout_s",
            "a stream whose client takes no bytes is paused, and aborted (its KV blocks freed) "
            "once paused this long",
        ),
        (
            "--max-json-depth",
            int,
            "max_json_depth",
            "request bodies nested deeper ([ and { levels) get 400 before they are parsed",
        ),
        (
            "--header-timeout-s",
            float,
            "header_timeout_s",
            "connections that send no complete request head within this long are closed",
        ),
        (
            "--max-connections",
            int,
            "max_connections",
            "open connections; beyond it a new one gets 503 (lowered to fit the file "
            "descriptor limit)",
        ),
        (
            "--health-stall-timeout-s",
            float,
            "health_stall_timeout_s",
            "/health answers 503 when no engine step finished for this long while work waits",
        ),
        (
            "--shutdown-timeout",
            float,
            "shutdown_timeout_s",
            "seconds in-flight requests get to finish after SIGTERM/SIGINT before they are "
            "aborted (then the prefix cache is saved and the server exits 0)",
        ),
        ("--preprocess-threads", int, "preprocess_threads", "threads tokenizing requests"),
        (
            "--max-consecutive-step-failures",
            int,
            "max_consecutive_step_failures",
            "failed engine steps in a row that restart the engine loop",
        ),
        (
            "--max-restarts",
            int,
            "max_restarts",
            "loop restarts allowed within --restart-window-s; one more stops the engine",
        ),
        ("--restart-window-s", float, "restart_window_s", "the window --max-restarts counts in"),
    ]
    for flag, kind, name, doc in flags:
        s.add_argument(flag, type=kind, default=getattr(_SERVER, name), help=doc)
    add_kv_events_args(s)
    s.add_argument(
        "--prefix-cache-dir",
        default=None,
        metavar="DIR",
        help="save the prefix cache here at shutdown (and on POST /save_cache), reload it at "
        "start if it was saved by the same weights, dtypes, block size and tokenizer",
    )


def add_kv_events_args(s: argparse.ArgumentParser) -> None:
    e = s.add_argument_group("KV events (vLLM's format over ZMQ, for routers that track caches)")
    e.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="ZMQ",
        help="publish every prefix-cache change here, e.g. tcp://*:5557 (bound: with * the "
        "events, prompt token ids included, are open on every interface) or ipc:///tmp/kv; "
        "a plain tcp://host:port is connected to, as vLLM does. Default: off",
    )
    e.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        metavar="ZMQ",
        help="a ROUTER socket where subscribers fetch missed batches by sequence number",
    )
    e.add_argument("--kv-events-topic", default="", help="the topic frame of every message")


def kv_events_config(args: argparse.Namespace) -> KVEventsConfig | None:
    if args.kv_events_endpoint is None:
        if args.kv_events_replay_endpoint is not None:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        return None
    return KVEventsConfig(
        args.kv_events_endpoint, args.kv_events_replay_endpoint, args.kv_events_topic
    )


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        api_keys=read_api_keys(args.api_keys),
        served_model_name=args.served_model_name,
        max_queued_requests=args.max_queued_requests,
        max_body_bytes=args.max_body_bytes,
        log_interval_s=args.log_interval,
        max_prompts_per_request=args.max_prompts_per_request,
        max_prompt_tokens_per_request=args.max_prompt_tokens_per_request,
        max_stop_strings=args.max_stop_strings,
        max_stop_chars=args.max_stop_chars,
        default_chat_max_tokens=args.default_chat_max_tokens,
        max_stream_buffer_events=args.max_stream_buffer_events,
        stream_stall_timeout_s=args.stream_stall_timeout_s,
        max_json_depth=args.max_json_depth,
        header_timeout_s=args.header_timeout_s,
        max_connections=args.max_connections,
        health_stall_timeout_s=args.health_stall_timeout_s,
        shutdown_timeout_s=args.shutdown_timeout,
        preprocess_threads=args.preprocess_threads,
        max_consecutive_step_failures=args.max_consecutive_step_failures,
        max_restarts=args.max_restarts,
        restart_window_s=args.restart_window_s,
        kv_events=kv_events_config(args),
        prefix_cache_dir=args.prefix_cache_dir,
    )


def read_api_keys(path: str | None) -> tuple[ApiKey, ...]:
    """--api-keys FILE's keys; () when not given."""
    if path is None:
        return ()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--api-keys: cannot read {path}: {e.strerror}") from e
    return parse_api_keys(text.splitlines(), f"--api-keys {path}")
