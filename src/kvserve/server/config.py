"""ServerConfig: the HTTP server's own settings (the engine's are in ``kvserve.config``).

Frozen and validated, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.server.tenants import tenant_keys

DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: far above any prompt that fits a context window


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None: no key needed (unless api_keys lists some)
    # (key, tenant) pairs from --api-keys; each tenant's prefix cache is its own
    api_keys: tuple[tuple[str, str], ...] = ()
    served_model_name: str | None = None  # None: the checkpoint's file or directory name
    # prompts waiting to start; beyond it requests are refused with 503 (an empty queue
    # takes any request)
    max_queued_requests: int = 256
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_interval_s: float = 10.0  # the periodic running / waiting / KV usage line

    @property
    def tenant_keys(self) -> dict[str, str]:
        """{key: tenant} of every accepted key; empty: the server takes no key."""
        return tenant_keys(self.api_key, dict(self.api_keys))

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (omit it for no key)")
        seen = set()
        for key, tenant in self.api_keys:
            if not key or not tenant:
                raise ValueError("api_keys entries need a non-empty key and tenant")
            if key in seen or key == self.api_key:
                raise ValueError("an API key is listed twice (in api_keys or as api_key)")
            seen.add(key)
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if not self.log_interval_s > 0:
            raise ValueError(f"log_interval_s must be positive, got {self.log_interval_s}")
