"""Tenants: API keys that name who is asking, and the prefix-cache salt that keeps tenants apart.

``--api-keys FILE`` holds one ``KEY TENANT`` pair per line (blank lines and ``#`` comments are
skipped). The key middleware puts the caller's tenant in the ASGI scope; the handlers salt
every request with it, so the prefix cache never shares a block across tenants. A client's own
``cache_salt`` only subdivides its tenant: ``salt_for`` encodes the pair injectively, so no
salt that tenant B can send equals any salt of tenant A's. The single ``--api-key`` is one
tenant, ``DEFAULT_TENANT``.

Metrics stay global, under vLLM's names: a tenant label would not be what vLLM dashboards read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from starlette.requests import Request

DEFAULT_TENANT = "default"  # the tenant of the single --api-key
SCOPE_KEY = "kvserve.tenant"  # where the key middleware leaves the caller's tenant


def parse_api_keys(lines: Iterable[str], source: str = "the API keys file") -> dict[str, str]:
    """{key: tenant} from ``KEY TENANT`` lines; raises ValueError naming the line."""
    keys: dict[str, str] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ValueError(
                f"{source}, line {number}: expected 'KEY TENANT' (two fields separated by "
                f"spaces), got {len(fields)} field(s)"
            )
        key, tenant = fields
        if key in keys:
            raise ValueError(f"{source}, line {number}: this key is already listed")
        keys[key] = tenant
    if not keys:
        raise ValueError(f"{source} lists no key")
    return keys


def tenant_keys(api_key: str | None, api_keys: Mapping[str, str]) -> dict[str, str]:
    """Every accepted key and its tenant: the file's, plus the single key as DEFAULT_TENANT."""
    keys = dict(api_keys)
    if api_key is not None:
        if api_key in keys:
            raise ValueError("--api-key is also listed in --api-keys; give it once")
        keys[api_key] = DEFAULT_TENANT
    return keys


def tenant_of(request: Request) -> str | None:
    """The caller's tenant; None when the server takes no keys (no tenants)."""
    return request.scope.get(SCOPE_KEY)


def salt_for(tenant: str | None, cache_salt: str | None) -> str | None:
    """The prefix-cache salt of a request. Without tenants it is the client's own salt, as
    vLLM's; with tenants a JSON pair, distinct for distinct (tenant, salt) pairs."""
    if tenant is None:
        return cache_salt
    return json.dumps([tenant, cache_salt])
