"""ServerConfig: the HTTP server's own settings (the engine's are in ``kvserve.config``).

Frozen and validated, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.server.tenants import ApiKey, tenant_keys

DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: far above any prompt that fits a context window
_SCHEMES = ("tcp://", "ipc://", "inproc://")  # ZMQ transports a KV events endpoint may use


def _at_least(name: str, value: int | float, low: int | float) -> None:
    if not value >= low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    endpoint: str = "tcp://*:5557"  # vLLM's default
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark (messages queued per subscriber)

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(_SCHEMES):
                raise ValueError(
                    f"{name} must start with one of {', '.join(_SCHEMES)}, got {value!r}"
                )
            if value is not None and value.startswith("tcp://"):
                port = value.rpartition(":")[2]
                if not port.isdigit() or not 0 < int(port) <= 65535:
                    raise ValueError(f"{name} must end in a port (1-65535), got {value!r}")
        if self.buffer_steps < 1 or self.hwm < 1:
            raise ValueError(
                f"buffer_steps and hwm must be >= 1, got {self.buffer_steps} and {self.hwm}"
            )


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # the operator's key (tenant "default", admin); None: no key needed (unless api_keys lists some)
    api_key: str | None = None
    # --api-keys: each tenant's prefix cache is its own; (key, tenant) pairs are taken as
    # ApiKey(key, tenant) (no admin role)
    api_keys: tuple[ApiKey, ...] = ()
    served_model_name: str | None = None  # None: the checkpoint's file or directory name
    # sequences (n x prompts) waiting to start, counted where requests enter; a request that
    # does not fit beside them gets 503 + Retry-After, one larger than the bound a 400
    max_queued_requests: int = 4096
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_interval_s: float = 10.0  # the periodic running / waiting / KV usage line
    # per-request bounds (400 naming the limit): one request never costs the others more
    # than this much tokenizing, queueing or per-token stop-string scanning
    max_prompts_per_request: int = 1024
    max_prompt_tokens_per_request: int = 1 << 18  # all prompts of one request together
    max_stop_strings: int = 32  # OpenAI allows 4; vLLM no limit; this bounds the per-token scan
    max_stop_chars: int = 4096  # total length of a request's stop strings
    # a chat completion that sends neither max_tokens nor max_completion_tokens generates at
    # most this many tokens (capped to the context left); vLLM's "all the context left" lets
    # a small model that never emits EOS run to the end of its window. /v1/completions keeps
    # OpenAI's and vLLM's 16 (serving.COMPLETIONS_DEFAULT_MAX_TOKENS)
    default_chat_max_tokens: int = 512
    # a stream whose client has this many events per sequence unread is aborted
    max_stream_buffer_events: int = 1024
    # a stream whose client takes no bytes (the connection holds more than stream_drain.py's
    # PAUSE_BYTES for it) is paused; paused this long without a break, it is aborted
    stream_stall_timeout_s: float = 30.0
    # a request body nested deeper than this ([ and { levels) is a 400 before it is parsed
    max_json_depth: int = 64
    # a connection that sends no complete request head within this long of opening (or of its
    # last response) is closed
    header_timeout_s: float = 15.0
    # open connections; one more is answered 503 and closed (lowered at start to fit the
    # process's file descriptor limit: server/connections.py)
    max_connections: int = 4096
    # /health turns 503 when no engine step has finished for this long while work waits
    health_stall_timeout_s: float = 30.0
    # SIGTERM / SIGINT: in-flight requests get this long to finish (new connections are
    # refused at once), then the rest are aborted, the prefix cache saved, exit 0; under
    # Kubernetes' default 30 s grace period so the save is not cut off
    shutdown_timeout_s: float = 10.0
    preprocess_threads: int = 2  # tokenizing / templating / validating, off the event loop
    # faults: this many failed engine steps in a row restart the loop; more than max_restarts
    # restarts within restart_window_s kill it (/health 503)
    max_consecutive_step_failures: int = 3
    max_restarts: int = 3
    restart_window_s: float = 60.0
    # publish prefix-cache changes over ZMQ in vLLM's format (server/kv_events.py); None: off
    kv_events: KVEventsConfig | None = None
    # where the prefix cache is saved at shutdown (and on POST /save_cache) and reloaded at
    # start when its fingerprint matches (kv/persist.py); None: not kept
    prefix_cache_dir: str | None = None

    @property
    def tenant_keys(self) -> dict[str, ApiKey]:
        """Every accepted key by its text; empty: the server takes no key."""
        return tenant_keys(self.api_key, self.api_keys)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (omit it for no key)")
        object.__setattr__(self, "api_keys", tuple(ApiKey(*k) for k in self.api_keys))
        seen = set()
        for key, tenant, _ in self.api_keys:
            if not key or not tenant:
                raise ValueError("api_keys entries need a non-empty key and tenant")
            if key in seen or key == self.api_key:
                raise ValueError("an API key is listed twice (in api_keys or as api_key)")
            seen.add(key)
        if self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if not self.log_interval_s > 0:
            raise ValueError(f"log_interval_s must be positive, got {self.log_interval_s}")
        for name in (
            "max_queued_requests",
            "max_prompts_per_request",
            "max_prompt_tokens_per_request",
            "max_stream_buffer_events",
            "max_json_depth",
            "max_connections",
            "preprocess_threads",
            "max_consecutive_step_failures",
            "default_chat_max_tokens",
        ):
            _at_least(name, getattr(self, name), 1)
        _at_least("max_restarts", self.max_restarts, 0)
        if not self.restart_window_s > 0:
            raise ValueError(f"restart_window_s must be positive, got {self.restart_window_s}")
        _at_least("max_stop_strings", self.max_stop_strings, 0)
        _at_least("max_stop_chars", self.max_stop_chars, 0)
        for name in ("stream_stall_timeout_s", "header_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.shutdown_timeout_s <= 3600:
            raise ValueError(
                f"shutdown_timeout_s must be in [0, 3600] seconds, got {self.shutdown_timeout_s}"
            )
        if not self.health_stall_timeout_s > 0:
            raise ValueError(
                f"health_stall_timeout_s must be positive, got {self.health_stall_timeout_s}"
            )
