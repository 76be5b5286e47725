"""The web view: a page at ``/`` (KV calculator, live block pool, chat) and its JSON,
``GET /v1/kv_state`` (server/kv_state.py).

The page and its assets are static files shipped in the package (``server/static/``), read
once when the app is built and answered without the API key (``WEB_VIEW_PATHS``, which the
key middleware leaves open): they hold no data. The page asks for the key when
``/v1/kv_state`` answers 401, keeps it in sessionStorage and sends it as ``Authorization:
Bearer``; the JSON stays behind the key like every other data route. Nothing is fetched from
elsewhere (no CDN; the Content-Security-Policy allows this origin only).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvserve.engine.engine import LLMEngine
from kvserve.server.engine_records import EngineDeadError
from kvserve.server.errors import APIError
from kvserve.server.kv_state import KVState, build_kv_state
from kvserve.server.serving import Served
from kvserve.server.tenants import is_admin, tenant_of

# path -> (file in server/static/, media type)
WEB_VIEW_ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
}
WEB_VIEW_PATHS = frozenset(WEB_VIEW_ASSETS)
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)


def read_assets() -> dict[str, tuple[bytes, str]]:
    static = files("kvserve.server").joinpath("static")
    return {
        path: (static.joinpath(name).read_bytes(), media)
        for path, (name, media) in WEB_VIEW_ASSETS.items()
    }


def add_web_view_routes(app: FastAPI, served: Callable[[], Served]) -> None:
    headers = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "Cache-Control": "no-cache"}
    for path, (body, media) in read_assets().items():

        def asset(body: bytes = body, media: str = media) -> Response:
            return Response(body, media_type=media, headers=headers)

        app.add_api_route(path, asset, methods=["GET"], include_in_schema=False)

    @app.get("/v1/kv_state")
    async def kv_state(request: Request) -> JSONResponse:
        """Every block's state, the request ids holding used blocks (a tenant's own only,
        unless its key is an admin's), the cache's shape, the engine's counts and the latest
        TTFT / TPOT (server/kv_state.py)."""
        s = served()
        loop = s.engine
        viewer = None if is_admin(request) else tenant_of(request)

        def read(engine: LLMEngine) -> KVState:  # on the loop thread, between two steps
            summary = loop.latency.summary()
            return build_kv_state(engine, s.model_name, summary, loop.num_waiting, viewer)

        try:
            state = await loop.call(read)
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_dead", headers={"Retry-After": "5"}) from e
        return JSONResponse(state.to_json(), headers={"Cache-Control": "no-store"})
