"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal is an ``APIError`` with its HTTP status. FastAPI's own 422 for a body that fails
validation, and Starlette's 404/405, are rewritten into this shape (validation is a 400, as
OpenAI answers it). Types follow OpenAI: invalid_request_error, authentication_error,
server_error; codes are short strings (context_length_exceeded, model_not_found, ...).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    503: "server_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    @property
    def type(self) -> str:
        if self.status >= 500:
            return "server_error"
        return _TYPES.get(self.status, "invalid_request_error")

    def body(self) -> ErrorResponse:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), self.status, headers=self.headers)

    def sse(self) -> str:
        """The in-band form, once a stream has begun."""
        return f"data: {self.body().model_dump_json()}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


# a smallest body per route, shown when the body is empty or not a JSON object
_EXAMPLES = {
    "/v1/chat/completions": '{"messages": [{"role": "user", "content": "Hello"}]}',
    "/detokenize": '{"tokens": [1, 2, 3]}',
}
_DEFAULT_EXAMPLE = '{"prompt": "Hello"}'


def validation_message(
    errors: Sequence[Mapping], path: str | None = None
) -> tuple[str, str | None]:
    """pydantic's errors (FastAPI's, or ``body_check``'s) as one message and the param.
    ``path``: the route, for an example body when the body itself is wrong."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # union members show up in loc as type names ("str", "list[int]"); keep the field path
    fields = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int")]
    param = ".".join(fields) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    got = first.get("input")
    if param is None and (whole := _whole_body_message(first.get("type"), got, path)):
        return whole, None
    if first.get("type") == "missing":
        return f"missing required parameter: {param}", param
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{param or 'body'}: {first.get('msg')}, got {_shown(got)}{more}", param


def _shown(got: object) -> str:
    try:
        return json.dumps(got)[:100]
    except (TypeError, ValueError):
        return repr(got)[:100]


def _whole_body_message(error_type: object, got: object, path: str | None) -> str | None:
    """The body itself is wrong (empty, not JSON, not an object): say so, with an example."""
    example = _EXAMPLES.get(path or "", _DEFAULT_EXAMPLE)
    how = f"send a JSON object with Content-Type: application/json, e.g. {example}"
    if error_type == "missing":  # FastAPI reads an empty body as no body at all
        return f"the request body is empty; {how}"
    if isinstance(got, bytes | bytearray):  # FastAPI parses JSON only under a JSON media type
        return f"the request body was not sent as JSON; {how}"
    if isinstance(got, Mapping):
        return None
    return f"the request body must be a JSON object, got {_shown(got)}; {how}"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors(), request.url.path)
        return bad_request(message, param, "invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), None, code, exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error")
        return APIError(500, f"internal error: {exc!r}", code="internal_error").response()
