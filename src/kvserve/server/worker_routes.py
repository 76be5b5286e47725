"""The worker side of the router protocol: what SGLang's router (and llm-d / vLLM's production
stack) ask a replica, answered as SGLang's and vLLM's servers answer it.

- ``/server_info`` (and the deprecated ``/get_server_info``, which SGLang's router falls back
  to): the served name and model path (the router names the worker's model by
  ``served_model_name``, else ``model_path``), context length, KV pool, dtype, version.
- ``/model_info`` (and ``/get_model_info``): model path, tokenizer path, ``is_generation``,
  HF ``model_type`` and ``architectures``.
- ``/get_load``: SGLang's shape, one record per data-parallel rank (kvserve has one):
  requests running and waiting, tokens held in the KV cache, and the pool's usage.
- ``/flush_cache`` (POST, as SGLang; GET too, as its older servers): drops the evictable
  prefix cache on the engine thread. Blocks of running requests are never touched; the
  answer says how many cached blocks were dropped.
- ``/save_cache`` (POST; kvserve's own, with ``--prefix-cache-dir``): writes the prefix cache
  to disk now (server/prefix_cache_dir.py), as shutdown does; the answer says how many
  blocks and bytes. One save at a time: a second caller gets 409 while one runs (each save
  holds a copy of the whole cache).

Every path sits behind the API key like the rest of the server (the router sends its own
``--api-key`` to workers as a bearer token). ``/flush_cache`` and ``/save_cache`` act on every
tenant's cache: they need an admin key (tenants.py; 403 otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvserve.server.engine_records import EngineDeadError, WorkerInfo
from kvserve.server.errors import APIError
from kvserve.server.prefix_cache_dir import SaveInProgressError
from kvserve.server.serving import Served
from kvserve.server.tenants import require_admin


def add_worker_routes(app: FastAPI, served: Callable[[], Served]) -> None:
    def info() -> WorkerInfo:
        s = served()
        assert s.info is not None, "load_served sets the worker info"
        return s.info

    def server_info() -> JSONResponse:
        i = info()
        body = asdict(i)
        body["architectures"] = list(i.architectures)
        # SGLang's names for the same facts, which routers read
        body |= {
            "tp_size": 1,
            "dp_size": 1,
            "max_total_num_tokens": i.num_kv_blocks * i.block_size,
            "max_running_requests": i.max_num_seqs,
            "max_prefill_tokens": i.max_num_batched_tokens,
            "page_size": i.block_size,
            "context_length": i.max_model_len,
        }
        return JSONResponse(body)

    def model_info() -> JSONResponse:
        i = info()
        return JSONResponse(
            {
                "model_path": i.model_path,
                "tokenizer_path": i.tokenizer_path,
                "is_generation": True,
                "model_type": i.model_type,
                "architectures": list(i.architectures),
                "served_model_name": i.served_model_name,
            }
        )

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server_info, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, model_info, methods=["GET"])

    @app.get("/get_load")
    async def get_load() -> JSONResponse:
        s = served()
        stats = s.engine.stats()
        block_size = info().block_size
        return JSONResponse(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": stats.num_running + stats.num_waiting,
                    "num_running_reqs": stats.num_running,
                    "num_waiting_reqs": stats.num_waiting,
                    # tokens the pool holds for running requests (whole blocks)
                    "num_tokens": stats.num_used_blocks * block_size,
                    "kv_cache_usage": stats.kv_cache_usage,
                }
            ]
        )

    async def flush_cache(request: Request) -> JSONResponse:
        require_admin(request)
        try:
            dropped = await served().engine.flush_prefix_cache()
        except EngineDeadError as e:  # the loop died or restarted first: nothing to flush now
            raise APIError(503, str(e), code="engine_dead", headers={"Retry-After": "5"}) from e
        return JSONResponse(
            {
                "success": True,
                "num_blocks_freed": dropped,
                "message": f"dropped {dropped} cached blocks; running requests keep theirs",
            }
        )

    app.add_api_route("/flush_cache", flush_cache, methods=["POST", "GET"])

    @app.post("/save_cache")
    async def save_cache(request: Request) -> JSONResponse:
        require_admin(request)
        s = served()
        if s.prefix_cache_dir is None:
            raise APIError(
                400, "this server keeps no prefix cache on disk: start it with --prefix-cache-dir"
            )
        try:
            report = await s.prefix_cache_dir.save(s.engine)
        except SaveInProgressError as e:
            raise APIError(
                409, str(e), code="save_in_progress", headers={"Retry-After": "5"}
            ) from e
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_dead", headers={"Retry-After": "5"}) from e
        except OSError as e:  # the directory or a non-regular file at the path (persist.py)
            raise APIError(500, f"the prefix cache was not saved: {e}", code="save_failed") from e
        return JSONResponse(
            {
                "success": True,
                "num_blocks_saved": report.num_blocks,
                "bytes": report.nbytes,
                "path": str(report.path),
            }
        )
