"""Errors to HTTP: every failure leaves the server as OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}`` with the status of its
:mod:`tokenloom.errors` class. Bad input never produces a 500 or a stack trace.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenloom.api.server_protocol import ErrorInfo, ErrorResponse
from tokenloom.errors import OverloadedError, TokenloomError

logger = logging.getLogger(__name__)

MAX_LISTED_PROBLEMS = 3
MAX_PROBLEM_CHARS = 200

# error "type" for statuses raised by Starlette itself (unknown route, wrong method, ...)
_TYPE_BY_STATUS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

# seconds a client should wait before retrying a request refused because the queue is full
RETRY_AFTER_SECONDS = 1

INTERNAL_ERROR_MESSAGE = "internal server error; the server log has the details (request id {request_id})"


def error_body(
    status: int, message: str, *, error_type: str | None = None, param: str | None = None, code: int | str | None = None
) -> dict[str, Any]:
    info = ErrorInfo(
        message=message,
        type=error_type or _TYPE_BY_STATUS.get(status, "Error"),
        param=param,
        code=code if code is not None else status,
    )
    return ErrorResponse(error=info).model_dump()


def error_json(status: int, message: str, **kwargs: Any) -> JSONResponse:
    return JSONResponse(error_body(status, message, **kwargs), status_code=status)


def exception_body(exc: TokenloomError) -> dict[str, Any]:
    return error_body(exc.status_code, exc.message, error_type=exc.error_type, param=exc.param, code=exc.code)


def exception_response(exc: TokenloomError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if isinstance(exc, OverloadedError) else None
    return JSONResponse(exception_body(exc), status_code=exc.status_code, headers=headers)


def sse_error_event(exc: BaseException, request_id: str) -> str:
    """The error event sent in place of further chunks when a stream fails midway."""
    if isinstance(exc, TokenloomError):
        body = exception_body(exc)
    else:
        body = error_body(500, INTERNAL_ERROR_MESSAGE.format(request_id=request_id))
    return f"data: {json.dumps(body)}\n\n"


def _shorten(text: str) -> str:
    return text if len(text) <= MAX_PROBLEM_CHARS else text[: MAX_PROBLEM_CHARS - 3] + "..."


def describe_validation_errors(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """A short message listing the first few problems with their field paths (never the input
    values, which may be huge), and the first problem's path as ``param``."""
    problems: list[str] = []
    first_param: str | None = None
    for error in errors:
        location = [str(part) for part in error.get("loc", ()) if part != "body"]
        path = ".".join(location)
        if error.get("type") == "json_invalid":
            detail = (error.get("ctx") or {}).get("error", "")
            problems.append(
                _shorten(
                    f"the request body is not valid JSON ({detail})" if detail else "the request body is not valid JSON"
                )
            )
            continue
        if not path and error.get("type") == "missing":
            problems.append("a JSON request body is required")
            continue
        first_param = first_param or path or None
        message = str(error.get("msg", "invalid value"))
        problems.append(_shorten(f"{path}: {message}" if path else message))
    shown = problems[:MAX_LISTED_PROBLEMS]
    more = len(problems) - len(shown)
    message = "invalid request: " + "; ".join(shown)
    if more > 0:
        message += f"; and {more} more problem{'s' if more > 1 else ''}"
    return message, first_param


def request_id_of(request: Request) -> str:
    request_id: str = request.scope.get("tokenloom.request_id", "-")  # RequestIdMiddleware sets a str
    return request_id


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TokenloomError)
    async def _tokenloom_error(request: Request, exc: TokenloomError) -> JSONResponse:
        return exception_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(list(exc.errors()))
        return error_json(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no route {request.url.path}"
        elif exc.status_code == 405:
            detail = f"method {request.method} is not allowed on {request.url.path}"
        return JSONResponse(error_body(exc.status_code, detail), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        request_id = request_id_of(request)
        logger.exception("request %s failed: %s", request_id, exc)
        return error_json(500, INTERNAL_ERROR_MESSAGE.format(request_id=request_id))
