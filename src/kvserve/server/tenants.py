"""Tenants: API keys that name who is asking, what they may do, and the prefix-cache salt that
keeps tenants apart.

``--api-keys FILE`` holds one ``KEY TENANT [admin]`` line per key (blank lines and ``#``
comments are skipped; a two-field line is a tenant's key, as before the role existed). The key
middleware puts the caller's tenant and role in the ASGI scope; the handlers salt every request
with the tenant, so the prefix cache never shares a block across tenants. A client's own
``cache_salt`` only subdivides its tenant: ``salt_for`` encodes the pair injectively, so no
salt that tenant B can send equals any salt of tenant A's.

Roles: an **admin** key may act on every tenant's state (``/flush_cache``, ``/save_cache``, and
every request id in ``/v1/kv_state``); a plain tenant key sees its own requests only and gets a
403 on the admin routes. The single ``--api-key`` is the operator's: the tenant
``DEFAULT_TENANT``, with the admin role (SGLang's router sends it to its workers, and calls
``/flush_cache`` with it). A server without keys has no tenants and no roles: everyone may do
everything, as before keys existed.

Metrics stay global, under vLLM's names: a tenant label would not be what vLLM dashboards read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import NamedTuple

from starlette.requests import Request

from kvserve.server.errors import APIError

DEFAULT_TENANT = "default"  # the tenant of the single --api-key
ADMIN_ROLE = "admin"  # the optional third field of an --api-keys line
SCOPE_KEY = "kvserve.tenant"  # where the key middleware leaves the caller's tenant
ADMIN_SCOPE_KEY = "kvserve.admin"  # ... and whether the caller's key is an admin's


class ApiKey(NamedTuple):
    """One accepted key: whose it is, and whether it may act on every tenant."""

    key: str
    tenant: str
    admin: bool = False


def parse_api_keys(lines: Iterable[str], source: str = "the API keys file") -> tuple[ApiKey, ...]:
    """The keys of ``KEY TENANT [admin]`` lines, in file order; raises ValueError naming the
    line."""
    keys: dict[str, ApiKey] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) not in (2, 3):
            raise ValueError(
                f"{source}, line {number}: expected 'KEY TENANT' or 'KEY TENANT {ADMIN_ROLE}' "
                f"(fields separated by spaces), got {len(fields)} field(s)"
            )
        if len(fields) == 3 and fields[2] != ADMIN_ROLE:
            raise ValueError(
                f"{source}, line {number}: the third field, when given, must be "
                f"'{ADMIN_ROLE}', got {fields[2]!r}"
            )
        key, tenant = fields[:2]
        if key in keys:
            raise ValueError(f"{source}, line {number}: this key is already listed")
        keys[key] = ApiKey(key, tenant, admin=len(fields) == 3)
    if not keys:
        raise ValueError(f"{source} lists no key")
    return tuple(keys.values())


def tenant_keys(api_key: str | None, api_keys: Iterable[ApiKey]) -> dict[str, ApiKey]:
    """Every accepted key by its text: the file's, plus the single key (DEFAULT_TENANT, admin)."""
    keys = {k.key: k for k in api_keys}
    if api_key is not None:
        if api_key in keys:
            raise ValueError("--api-key is also listed in --api-keys; give it once")
        keys[api_key] = ApiKey(api_key, DEFAULT_TENANT, admin=True)
    return keys


def tenant_of(request: Request) -> str | None:
    """The caller's tenant; None when the server takes no keys (no tenants)."""
    return request.scope.get(SCOPE_KEY)


def is_admin(request: Request) -> bool:
    """Whether the caller may act on every tenant: an admin key, or a server without keys (the
    key middleware then never runs, and the scope holds no tenant)."""
    if SCOPE_KEY not in request.scope:
        return True
    return request.scope.get(ADMIN_SCOPE_KEY) is True


def require_admin(request: Request) -> None:
    """Raise a 403 (OpenAI's error shape) unless the caller may act on every tenant."""
    if not is_admin(request):
        raise APIError(
            403,
            f"{request.url.path} acts on every tenant's cache: it needs an admin key "
            f"(the --api-key, or an --api-keys line 'KEY TENANT {ADMIN_ROLE}')",
            code="permission_denied",
        )


def salt_for(tenant: str | None, cache_salt: str | None) -> str | None:
    """The prefix-cache salt of a request. Without tenants it is the client's own salt, as
    vLLM's; with tenants a JSON pair, distinct for distinct (tenant, salt) pairs."""
    if tenant is None:
        return cache_salt
    return json.dumps([tenant, cache_salt])


def tenant_of_salt(salt: str | None) -> str | None:
    """The tenant ``salt_for`` put in a salt; None for a salt it did not make with a tenant
    (a server without keys, or an engine used directly)."""
    if salt is None or not salt.startswith("["):
        return None
    try:
        pair = json.loads(salt)
    except ValueError:
        return None
    if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str):
        return pair[0]
    return None
