"""tokenloom's own ASGI middleware (pure ASGI, no BaseHTTPMiddleware) and the loader of
``--middleware`` import paths.

Order, outermost first (a request meets them top-down; :func:`install_middleware` adds them)::

    --middleware objects   (added last, so outermost, as in vLLM)
    CORSMiddleware         preflights are answered, and 401/413 responses carry CORS headers
    RequestIdMiddleware    every response, errors included, can carry X-Request-Id
    ApiKeyMiddleware       401 before the body is even read
    ClientMiddleware       names the client (its API key, else its address) for per-client limits
    BodySizeLimitMiddleware 413 for bodies over --max-request-body-bytes
    ServerLoadMiddleware   with --enable-server-load-tracking: counts requests in flight
    TraceContextMiddleware with --otlp-traces-endpoint: keeps the W3C trace headers for the spans
    the routes
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import logging
import secrets
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenloom.api.http_errors import error_body
from tokenloom.api.server_config import ServerConfig
from tokenloom.api.tracing import TraceContextMiddleware
from tokenloom.core.structured_output_compile import REQUEST_CLIENT
from tokenloom.errors import ConfigError

logger = logging.getLogger("tokenloom.api")

REQUEST_ID_SCOPE_KEY = "tokenloom.request_id"
REQUEST_ID_HEADER = b"x-request-id"
# reachable without the API key (load balancers and probes have no key)
PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/load"})
# Anthropic's Messages routes, whose clients expect Anthropic's error shape
ANTHROPIC_PATH_PREFIX = "/v1/messages"


def route_path(scope: Scope) -> str:
    """The path as the router sees it: without the ``root_path`` prefix servers may include."""
    path: str = scope.get("path", "")
    root_path: str = scope.get("root_path", "")
    if root_path and path.startswith(root_path):
        path = path[len(root_path) :] or "/"
    return path


def header_value(scope: Scope, name: bytes) -> bytes | None:
    headers: Iterable[tuple[bytes, bytes]] = scope.get("headers", ())
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


async def send_error(send: Send, status: int, message: str, extra_headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer KEY`` (or Anthropic's ``x-api-key: KEY``) on every
    route but the public ones; Anthropic's routes get Anthropic's error shape."""

    def __init__(
        self,
        app: ASGIApp,
        api_keys: list[str],
        metrics_require_key: bool = False,
        plugin_public_paths: frozenset[str] = frozenset(),
    ):
        self.app = app
        self.api_keys = [key.encode() for key in api_keys]
        # with the paths plugins declared public when registering their routes (``public_paths=[...]``)
        self.public_paths = (PUBLIC_PATHS if metrics_require_key else PUBLIC_PATHS | {"/metrics"}) | plugin_public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        if route_path(scope) in self.public_paths or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        message = "missing or wrong API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
        if route_path(scope).startswith(ANTHROPIC_PATH_PREFIX):
            body = json.dumps({"type": "error", "error": {"type": "authentication_error", "message": message}})
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                }
            )
            await send({"type": "http.response.body", "body": body.encode()})
            return
        await send_error(send, 401, message, [(b"www-authenticate", b"Bearer")])

    def _authorized(self, scope: Scope) -> bool:
        header = header_value(scope, b"authorization") or b""
        scheme, _, token = header.partition(b" ")
        if scheme.lower() == b"bearer":
            token = token.strip()
        else:
            # Anthropic's clients send the key in x-api-key
            token = (header_value(scope, b"x-api-key") or b"").strip()
            if not token:
                return False
        # compare against every key so the timing does not say which one nearly matched
        matches = [secrets.compare_digest(token, key) for key in self.api_keys]
        return any(matches)


def presented_api_key(scope: Scope) -> bytes | None:
    """The key a request presents: ``Authorization: Bearer KEY``, else ``x-api-key: KEY``."""
    scheme, _, token = (header_value(scope, b"authorization") or b"").partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        return token.strip()
    return (header_value(scope, b"x-api-key") or b"").strip() or None


class ClientMiddleware:
    """Sets :data:`~tokenloom.core.structured_output_compile.REQUEST_CLIENT` for the request: its API
    key (a digest of it) when the server checks keys, else its peer address; a client cannot
    pick a new identity for free, since a key it makes up is refused and an address is the
    TCP peer's. Behind a proxy every client shares the proxy's address."""

    def __init__(self, app: ASGIApp, keyed: bool):
        self.app = app
        self.keyed = keyed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = presented_api_key(scope) if self.keyed else None
        if key is not None:
            client = "key:" + hashlib.sha256(key).hexdigest()[:16]
        else:
            peer = scope.get("client")
            client = f"peer:{peer[0]}" if peer else "peer:unknown"
        token = REQUEST_CLIENT.set(client)
        try:
            await self.app(scope, receive, send)
        finally:
            REQUEST_CLIENT.reset(token)


class RequestIdMiddleware:
    """Gives every request an id (the client's X-Request-Id, or a new one) in the scope for
    logs and the engine; echoes it as X-Request-Id when ``add_header`` is set."""

    def __init__(self, app: ASGIApp, add_header: bool = False):
        self.app = app
        self.add_header = add_header

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client_id = header_value(scope, REQUEST_ID_HEADER)
        request_id = client_id.decode("latin-1")[:256] if client_id else uuid.uuid4().hex
        scope[REQUEST_ID_SCOPE_KEY] = request_id
        if not self.add_header:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != REQUEST_ID_HEADER]
                headers.append((REQUEST_ID_HEADER, request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class ServerLoad:
    """``--enable-server-load-tracking``'s counter: requests in flight on the model's routes,
    what ``GET /load`` reports as ``server_load`` (vLLM's route, for load balancers)."""

    # the routes that occupy the engine (vLLM counts its generation and pooling routes)
    TRACKED_PATHS = frozenset(
        {
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/responses",
            "/v1/messages",
            "/v1/embeddings",
            "/pooling",
            "/v1/score",
            "/v1/rerank",
            "/v2/rerank",
        }
    )

    def __init__(self) -> None:
        self.in_flight = 0


class ServerLoadMiddleware:
    """Counts a tracked request from its arrival until its response is sent in full: a
    streamed response counts until its last chunk, and a failed or disconnected request is
    uncounted as its handler ends."""

    def __init__(self, app: ASGIApp, load: ServerLoad):
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) not in ServerLoad.TRACKED_PATHS:
            await self.app(scope, receive, send)
            return
        self.load.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.in_flight -= 1


class BodySizeLimitMiddleware:
    """413 for a body over ``max_bytes``: by Content-Length up front, else by counting the
    streamed chunks (chunked uploads have no length) before the app sees any of them."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        declared = header_value(scope, b"content-length")
        if declared is not None:
            try:
                declared_bytes = int(declared)
            except ValueError:
                await send_error(send, 400, "the Content-Length header is not a number")
                return
            if declared_bytes > self.max_bytes:
                await self._too_large(send, declared_bytes)
                return
        # Buffer the body while counting, then replay it: the app only ever sees a body that
        # fits. FastAPI reads the whole body before calling a route anyway.
        messages: list[Message] = []
        received = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                await self._too_large(send, received, at_least=True)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            if messages:
                return messages.pop(0)
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send, size: int, at_least: bool = False) -> None:
        size_text = f"more than {self.max_bytes}" if at_least else str(size)
        await send_error(
            send,
            413,
            f"request body too large: {size_text} bytes, the limit is {self.max_bytes} "
            "bytes (--max-request-body-bytes)",
        )


def import_object(path: str, flag: str) -> Any:
    """``package.module.attr`` or ``package.module:attr``; a bad path is a ConfigError naming it."""
    module_name, sep, attr = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{flag} {path!r}: expected an import path like 'my_package.module.attr'", param=flag)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(
            f"{flag} {path!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}", param=flag
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{flag} {path!r}: module {module_name!r} has no attribute {attr!r}", param=flag) from None


def add_user_middleware(app: FastAPI, import_paths: list[str]) -> None:
    """``--middleware``: a class is added with ``app.add_middleware``, an async function
    becomes ``@app.middleware("http")``."""
    for path in import_paths:
        target = import_object(path, "--middleware")
        if inspect.isclass(target):
            # an imported class: whether its constructor takes (app) shows only when Starlette builds the stack
            app.add_middleware(target)  # type: ignore[arg-type]
        elif inspect.iscoroutinefunction(target):
            app.middleware("http")(target)
        else:
            raise ConfigError(
                f"--middleware {path!r}: expected an ASGI middleware class or an async function "
                f"(request, call_next), got {type(target).__name__}",
                param="--middleware",
            )


def install_middleware(
    app: FastAPI, config: ServerConfig, api_keys: list[str], public_paths: frozenset[str] = frozenset()
) -> None:
    """Adds tokenloom's middleware in the documented order; Starlette wraps each added one
    around the previous ones, so the first added is the innermost."""
    if not api_keys and "*" in (config.allowed_origins or ()):
        # vLLM's default (any origin) is kept for compatibility, but without a key it means any
        # web page the operator's browser opens can drive this server: say so at start-up
        logger.warning(
            "the server accepts requests without an API key and allows every CORS origin, so any "
            "web page opened in a browser that can reach it can use it; set --api-key (or "
            "TOKENLOOM_API_KEY), or narrow --allowed-origins"
        )
    if config.otlp_traces_endpoint:
        app.add_middleware(TraceContextMiddleware)
    if config.enable_server_load_tracking:
        app.add_middleware(ServerLoadMiddleware, load=app.state.server_load)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_request_body_bytes)
    app.add_middleware(ClientMiddleware, keyed=bool(api_keys))
    if api_keys:
        app.add_middleware(
            ApiKeyMiddleware,
            api_keys=api_keys,
            metrics_require_key=config.metrics_require_key,
            plugin_public_paths=public_paths,
        )
    app.add_middleware(RequestIdMiddleware, add_header=config.enable_request_id_headers)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=config.allowed_origins,
        allow_methods=config.allowed_methods,
        allow_headers=config.allowed_headers,
        allow_credentials=config.allow_credentials,
    )
    add_user_middleware(app, config.middleware)
