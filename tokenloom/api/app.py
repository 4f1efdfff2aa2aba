"""``build_app``: the FastAPI app assembled from the engine, the plugin registries and the
server options: OpenAI routes, tokenize/detokenize, health, version, metrics, plugin routes,
then middleware (see :mod:`tokenloom.api.middleware` for their order)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenloom import __version__
from tokenloom.api.http_errors import INTERNAL_ERROR_MESSAGE, error_json, install_error_handlers, request_id_of
from tokenloom.api.metrics import ServerMetrics, log_stats_periodically
from tokenloom.api.middleware import ServerLoad, install_middleware
from tokenloom.api.multimodal_inputs import MultiModalInputs
from tokenloom.api.prompt_inputs import OFF_LOOP_TOKENIZE_CHARS, off_loop_if_large
from tokenloom.api.protocol import ChatCompletionRequest, CompletionRequest
from tokenloom.api.response_store import ResponseStore, store_size_from_env
from tokenloom.api.server_config import ServerConfig
from tokenloom.api.server_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from tokenloom.api.serving_base import ServingContext
from tokenloom.api.serving_chat import ChatHandler, render_chat_request
from tokenloom.api.serving_completions import CompletionsHandler
from tokenloom.api.serving_messages import MessagesHandler, messages_routes
from tokenloom.api.serving_models import parse_lora_modules, runtime_lora_updating_allowed
from tokenloom.api.serving_pooling import pooling_routes
from tokenloom.api.serving_responses import ResponsesHandler, responses_routes
from tokenloom.api.tracing import RequestTracer
from tokenloom.chat_template import ChatRenderer, load_chat_template
from tokenloom.errors import ConfigError, InvalidRequestError, PluginError, TokenloomError

if TYPE_CHECKING:
    from tokenloom.core.engine.protocol import EngineClient
    from tokenloom.plugins.manager import PluginSet

logger = logging.getLogger(__name__)

API_KEY_ENV = "TOKENLOOM_API_KEY"
# routes only a generating model serves (a pooling model gets serving_pooling's instead)
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def _api_keys(config: ServerConfig) -> list[str]:
    """The keys in force: ``--api-key``'s, else TOKENLOOM_API_KEY's. A blank key is no key, as
    in vLLM: ``--api-key "$UNSET"`` must not make ``Authorization: Bearer`` with nothing after
    it a valid key (build_app warns that the server then runs without one)."""
    given = [config.api_key] if isinstance(config.api_key, str) else list(config.api_key or ())
    keys = [key for key in given if key.strip()]
    if keys:
        return keys
    from_env = os.environ.get(API_KEY_ENV, "")
    return [from_env] if from_env.strip() else []


def _warn_of_blank_api_keys(config: ServerConfig, api_keys: list[str]) -> None:
    given = [config.api_key] if isinstance(config.api_key, str) else list(config.api_key or ())
    num_blank = sum(1 for key in given if not key.strip())
    if not num_blank:
        return
    logger.warning(
        "--api-key was given %d empty key%s (an unset shell variable?), ignored; %s",
        num_blank,
        "" if num_blank == 1 else "s",
        "the other keys apply" if api_keys else "the server runs WITHOUT an API key: anyone who reaches it can use it",
    )


def _parser_class(plugins: PluginSet | None, kind: str, name: str | None) -> type[Any] | None:
    """The parser class registered under ``name``; an unknown name fails start-up, listing the known ones."""
    if not name:
        return None
    if plugins is None:
        raise ConfigError(f"{name!r} was asked for as a {kind}, but no plugins were loaded", param=kind)
    parser_class: type[Any] = plugins.registry(kind).get(name)  # the registry holds "module:Class" targets
    return parser_class


def _lifespan(
    engine: EngineClient, config: ServerConfig, tracer: RequestTracer | None
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        stats_task = None if config.disable_log_stats else asyncio.create_task(log_stats_periodically(engine))
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stats_task
            await engine.shutdown()
            if tracer is not None:
                # the spans still batched go out before the process ends (off the event loop)
                await asyncio.to_thread(tracer.shutdown)

    return lifespan


async def _guarded(raw_request: Request, work: Awaitable[Response]) -> Response:
    """Runs a route; an unexpected exception becomes a logged, generic 500 (Starlette would
    re-raise it after answering, taking the traceback to the server's error log twice)."""
    try:
        return await work
    except TokenloomError:
        raise
    except Exception:
        request_id = request_id_of(raw_request)
        logger.exception("request %s failed", request_id)
        return error_json(500, INTERNAL_ERROR_MESSAGE.format(request_id=request_id))


def build_app(
    engine: EngineClient, plugins: PluginSet | None, server_config: ServerConfig, *, reasoning_parser: str | None = None
) -> FastAPI:
    """The app for ``engine``; ``plugins`` supplies parsers and extra routes (None: only the
    built-in routes, no parsers).

    :param reasoning_parser: the ``--reasoning-parser`` name (an engine argument, since the
        structured-output layer needs it too).
    """
    config = server_config
    if config.enable_auto_tool_choice and not config.tool_call_parser:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser", param="--tool-call-parser")
    tool_parser_class = _parser_class(plugins, "tool_parser", config.tool_call_parser)
    reasoning_parser_class = _parser_class(plugins, "reasoning_parser", reasoning_parser)

    metrics = ServerMetrics(engine, engine.served_model_names[0])
    ctx = ServingContext(engine, config, metrics, MultiModalInputs.for_engine(engine, plugins, config))
    if config.otlp_traces_endpoint:
        ctx.tracer = RequestTracer(config.otlp_traces_endpoint, engine.served_model_names[0])
        if config.collect_detailed_traces:
            logger.warning(
                "--collect-detailed-traces %s: the request spans carry the queue, prefill, decode and "
                "inference times; no per-module spans are added (as in vLLM's V1 engine)",
                " ".join(config.collect_detailed_traces),
            )
    renderer = ChatRenderer(
        engine.tokenizer,
        load_chat_template(config.chat_template),
        config.chat_template_content_format,
        trust_request_chat_template=config.trust_request_chat_template,
        placeholders=ctx.multimodal.placeholders,
    )
    ctx.models.add_static(parse_lora_modules(config.lora_modules))
    completions = CompletionsHandler(ctx)
    chat = ChatHandler(ctx, renderer, config.response_role, tool_parser_class, reasoning_parser_class)

    docs: dict[str, Any] = (
        {} if not config.disable_fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    )
    # --root-path is given to uvicorn (run_server), which puts it in every request's scope
    app = FastAPI(title="tokenloom", version=__version__, lifespan=_lifespan(engine, config, ctx.tracer), **docs)
    app.state.engine = engine
    app.state.serving = ctx
    app.state.metrics = metrics
    app.state.server_load = ServerLoad()  # counted only with --enable-server-load-tracking
    install_error_handlers(app)
    api_keys = _api_keys(config)
    _warn_of_blank_api_keys(config, api_keys)
    routes = _routes(ctx, renderer, completions, chat, metrics)
    if engine.runner_type != "pooling":
        # the agent APIs are layers over chat, which a pooling model does not serve
        keys_in_use = bool(api_keys)
        routes.include_router(
            responses_routes(
                ResponsesHandler(
                    chat, ResponseStore(store_size_from_env(), config.responses_store_max_bytes), keys_in_use
                ),
                _guarded,
            )
        )
        routes.include_router(messages_routes(MessagesHandler(chat)))
    else:
        # a pooling model serves embeddings and scores, never completions
        routes.routes = [route for route in routes.routes if getattr(route, "path", None) not in GENERATION_PATHS]
        routes.include_router(pooling_routes(ctx, _guarded))
    app.include_router(routes)
    public_paths: set[str] = set()
    if plugins is not None:
        for entry in plugins.registry("api_route").entries():
            logger.info("adding API routes %r from plugin %r", entry.name, entry.plugin_name)
            num_routes = len(app.router.routes)
            entry.resolve()(app, engine)
            _warn_of_shadowed_routes(app.router.routes[:num_routes], app.router.routes[num_routes:], entry)
            public_paths |= _declared_public_paths(entry)
    install_middleware(app, config, api_keys, public_paths=frozenset(public_paths))
    return app


def _route_keys(routes: list[Any], prefix: str = "") -> set[tuple[str, str]]:
    """``(path, method)`` of every endpoint among ``routes``, through included routers (newer
    FastAPI keeps an included router whole, with its prefix, instead of copying its routes)."""
    keys: set[tuple[str, str]] = set()
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            keys |= _route_keys(
                included.routes, prefix + getattr(getattr(route, "include_context", None), "prefix", "")
            )
        elif hasattr(route, "path"):
            keys |= {(prefix + route.path, method) for method in (getattr(route, "methods", None) or {"*"})}
    return keys


def _warn_of_shadowed_routes(earlier: list[Any], added: list[Any], entry: Any) -> None:
    """The router answers with the first route that matches: a plugin route on a path and
    method taken before it is never reached, so say so rather than let it fail silently."""
    taken = _route_keys(earlier)
    for path, method in sorted(_route_keys(added) & taken):
        logger.warning(
            "plugin %r (API routes %r) adds %s %s, which is already served (a built-in route or an "
            "earlier plugin's); the earlier route answers and the plugin's is unreachable: give it "
            "another path",
            entry.plugin_name,
            entry.name,
            method,
            path,
        )


def _declared_public_paths(entry: Any) -> set[str]:
    """``register(name, target, public_paths=["/my/status"])``: paths served without the API key."""
    paths = entry.options.get("public_paths", ())
    if isinstance(paths, str) or not all(isinstance(path, str) and path.startswith("/") for path in paths):
        raise PluginError(
            f"plugin {entry.plugin_name!r} registered API routes {entry.name!r} with "
            f"public_paths={paths!r}: expected a list of paths such as ['/my-plugin/status']"
        )
    return set(paths)


# vLLM's switch for its development routes, and tokenloom's own spelling of it
SERVER_DEV_MODE_ENV = ("VLLM_SERVER_DEV_MODE", "TOKENLOOM_SERVER_DEV_MODE")


def server_dev_mode() -> bool:
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on") for name in SERVER_DEV_MODE_ENV)


def _routes(
    ctx: ServingContext,
    renderer: ChatRenderer,
    completions: CompletionsHandler,
    chat: ChatHandler,
    metrics: ServerMetrics,
) -> APIRouter:
    router = APIRouter()
    engine = ctx.engine

    @router.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await _guarded(raw_request, completions.create(request, raw_request))

    @router.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await _guarded(raw_request, chat.create(request, raw_request))

    @router.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(ModelList(data=ctx.models.model_cards(engine.model_name)).model_dump())

    if runtime_lora_updating_allowed():
        # vLLM's runtime adapter routes, only when VLLM_ALLOW_RUNTIME_LORA_UPDATING is true
        @router.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
            await ctx.models.load(request.lora_name, request.lora_path, request.base_model_name)
            return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

        @router.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
            await ctx.models.unload(request.lora_name, request.lora_int_id)
            return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")

    if server_dev_mode():
        # vLLM's development route, only when VLLM_SERVER_DEV_MODE is true
        @router.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> Response:
            await engine.reset_prefix_cache()
            return Response(status_code=200)

    @router.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> JSONResponse:
        ctx.check_model(request.model)
        ctx.warn_unknown_fields(request, "/tokenize")
        ctx.require_tokenizer("/tokenize", "prompt")
        if request.messages is not None:
            text = await render_chat_request(renderer, request)
            add_special_tokens = bool(request.add_special_tokens)
        elif request.prompt is not None:
            text = request.prompt
            add_special_tokens = request.add_special_tokens is not False
        else:
            raise InvalidRequestError('send either "prompt" (a string) or "messages" (a chat)', param="prompt")

        def tokenize_text() -> tuple[list[int], list[str] | None]:
            token_ids = ctx.tokenize(text, add_special_tokens)
            return token_ids, ctx.tokenizer.convert_ids_to_tokens(token_ids) if request.return_token_strs else None

        token_ids, token_strs = await off_loop_if_large(len(text), OFF_LOOP_TOKENIZE_CHARS, tokenize_text)
        body = TokenizeResponse(
            count=len(token_ids), max_model_len=ctx.max_model_len, tokens=token_ids, token_strs=token_strs
        )
        return JSONResponse(body.model_dump())

    @router.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> JSONResponse:
        ctx.check_model(request.model)
        ctx.require_tokenizer("/detokenize", "tokens")
        text = await ctx.detokenize(request.tokens, "tokens")
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    async def health() -> Response:
        ctx.check_ready()
        return Response(status_code=200)

    router.add_api_route("/health", health, methods=["GET"], operation_id="health")
    router.add_api_route("/ping", health, methods=["GET"], operation_id="ping")
    router.add_api_route("/ping", health, methods=["POST"], operation_id="ping_post")

    @router.get("/load")
    async def server_load(raw_request: Request) -> JSONResponse:
        # vLLM's route: requests in flight, counted under --enable-server-load-tracking (0 without)
        return JSONResponse({"server_load": raw_request.app.state.server_load.in_flight})

    @router.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router
