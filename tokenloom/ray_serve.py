"""tokenloom on Ray Serve: one OpenAI-compatible application over one or more models, each a
Ray Serve deployment of its own (replicas, autoscaling and health checks Ray Serve's), behind one
ingress that routes each request by its ``model`` field, as Ray Serve LLM's ``build_openai_app``
does for vLLM.

    from ray import serve
    from tokenloom.ray_serve import ModelConfig, build_openai_app

    app = build_openai_app([
        ModelConfig("smollm2", engine_kwargs={"max_model_len": 2048},
                    deployment_config={"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}),
        ModelConfig("/models/qwen3-1.7b.gguf", model_id="qwen3"),
    ])
    serve.run(app)

From a Ray Serve config file (``serve run config.yaml``, or a KubeRay ``RayService``'s
``serveConfigV2``), ``import_path: tokenloom.ray_serve:app_builder`` with ``args: {models: [...]}``,
each model the fields of :class:`ModelConfig`.

Each model replica (:class:`ModelServer`) runs tokenloom's own FastAPI app and engine in the
replica's event loop: a request reaches it as raw HTTP (method, path, headers, body) and its
response streams back message by message, so every route, error and stream is the one
``tokenloom serve`` gives. Its ``check_health`` is the engine's: a dead engine fails Ray Serve's
health check and the replica is replaced. Needs the ``serve`` extra (``ray[serve]``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tokenloom.errors import ConfigError

# one message of a response, as the ingress receives it: ("start", status, headers) first, then
# ("body", bytes) for each chunk
ResponseMessage = tuple[Any, ...]


@dataclass
class ModelConfig:
    """One model of the application: what ``tokenloom serve`` would be given for it."""

    model: str
    """The model (a directory, a .gguf file, a packaged name), as ``tokenloom serve MODEL``."""
    model_id: str | None = None
    """The name requests use (``--served-model-name``); the model's own name by default."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Engine and server flags by their Python names (``max_model_len``, ``tensor_parallel_size``,
    ``tool_call_parser``, ...), as vLLM's engine arguments."""
    deployment_config: dict[str, Any] = field(default_factory=dict)
    """Ray Serve deployment options passed through (``autoscaling_config``, ``num_replicas``,
    ``ray_actor_options``, ``health_check_period_s``, ...)."""

    def serve_argv(self) -> list[str]:
        """The ``tokenloom serve`` command line this config stands for."""
        argv = [self.model]
        if self.model_id is not None:
            argv += ["--served-model-name", self.model_id]
        for name, value in self.engine_kwargs.items():
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                argv.append(f"{flag}={str(value).lower()}")
            elif isinstance(value, (dict, list)):
                argv += [flag, json.dumps(value)]
            else:
                argv += [flag, str(value)]
        return argv


class ModelServer:
    """A replica of one model: tokenloom's engine and app, answering raw HTTP requests."""

    async def __init__(self, config: ModelConfig) -> None:
        from tokenloom.api.app import build_app
        from tokenloom.api.serve_args import check_plugin_choices, parse_serve_args
        from tokenloom.core.engine import build_engine_client
        from tokenloom.plugins.manager import load_plugins

        serve_args = parse_serve_args(config.serve_argv())
        server = serve_args.server
        plugins = load_plugins(modules=server.plugins, files=server.tool_parser_plugin, strict=server.strict_plugins)
        serve_args.plugins = plugins
        check_plugin_choices(serve_args)
        self.engine = await asyncio.get_running_loop().run_in_executor(
            None, build_engine_client, serve_args.engine_args, plugins
        )
        self.app = build_app(
            self.engine, plugins, serve_args.server, reasoning_parser=serve_args.engine_args.reasoning_parser
        )
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts the engine

    def served_model_names(self) -> list[str]:
        return list(self.engine.served_model_names)

    async def check_health(self) -> None:
        """Ray Serve's health check: raises while the engine is dead (the replica is replaced)."""
        if self.engine.errored:
            raise RuntimeError(f"the tokenloom engine stopped: {self.engine.dead_reason}")

    async def handle(
        self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> AsyncIterator[ResponseMessage]:
        """Runs one HTTP request through the app; yields its response's messages as they come."""
        messages: asyncio.Queue[ResponseMessage | None] = asyncio.Queue()
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": query,
            "headers": headers,
            "client": ("ray-serve", 0),
            "server": ("tokenloom", 0),
            "state": {},
        }
        received = False
        disconnected = asyncio.Event()

        async def receive() -> dict[str, Any]:
            nonlocal received
            if not received:
                received = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()  # the app asks once the response is done, or to watch for a cancel
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                await messages.put(("start", message["status"], list(message.get("headers", []))))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    await messages.put(("body", bytes(message["body"])))
                if not message.get("more_body", False):
                    await messages.put(None)

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            finally:
                await messages.put(None)

        task = asyncio.ensure_future(run())
        try:
            while (message := await messages.get()) is not None:
                yield message
        finally:
            disconnected.set()  # the ingress went away (or the response ended): the app sees it
            if not task.done():
                task.cancel()


class Router:
    """The application's ingress: routes a request to its model's deployment by the ``model``
    field of its JSON body; ``GET /v1/models`` lists every model."""

    def __init__(self, servers: dict[str, Any]) -> None:
        self.servers = servers  # model id -> DeploymentHandle of its ModelServer

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, StreamingResponse

        body = await request.body()
        if request.method == "GET" and request.url.path.rstrip("/") == "/v1/models":
            return JSONResponse(await self._models())
        name = _model_field(body)
        if name is None and len(self.servers) == 1:
            name = next(iter(self.servers))
        if name not in self.servers:
            known = ", ".join(sorted(self.servers))
            return JSONResponse(
                {
                    "error": {
                        "message": f"The model `{name}` does not exist: this application serves {known}",
                        "type": "NotFoundError",
                        "param": "model",
                        "code": 404,
                    }
                },
                status_code=404,
            )
        stream = (
            self.servers[name]
            .options(stream=True)
            .handle.remote(request.method, request.url.path, request.url.query.encode(), request.headers.raw, body)
        )
        start = await stream.__anext__()
        _, status, headers = start

        async def chunks() -> AsyncIterator[bytes]:
            async for message in stream:
                yield message[1]

        response = StreamingResponse(chunks(), status_code=status)
        response.raw_headers = [(key, value) for key, value in headers if key.lower() != b"content-length"]
        return response

    async def _models(self) -> dict[str, Any]:
        listed: list[dict[str, Any]] = []
        for name, handle in self.servers.items():
            messages = [m async for m in handle.options(stream=True).handle.remote("GET", "/v1/models", b"", [], b"")]
            payload = json.loads(b"".join(m[1] for m in messages if m[0] == "body"))
            listed += [entry for entry in payload["data"] if entry["id"] == name]
        return {"object": "list", "data": listed}


def _model_field(body: bytes) -> str | None:
    try:
        payload = json.loads(body) if body else None
    except ValueError:
        return None
    name = payload.get("model") if isinstance(payload, dict) else None
    return name if isinstance(name, str) else None


def build_openai_app(models: list[ModelConfig]) -> Any:
    """The Ray Serve application (``serve.run(app)``): one deployment per model, named after its
    model id, behind the :class:`Router` ingress."""
    try:
        from ray import serve
    except ImportError as exc:
        raise ConfigError(
            f"tokenloom on Ray Serve needs Ray Serve: pip install 'tokenloom[serve]' ({exc})", param="ray_serve"
        ) from None
    if not models:
        raise ConfigError("build_openai_app needs at least one ModelConfig", param="models")
    servers: dict[str, Any] = {}
    for config in models:
        model_id = config.model_id or config.model
        if model_id in servers:
            raise ConfigError(f"two models are named {model_id!r}: give each its own model_id", param="model_id")
        config = ModelConfig(config.model, model_id, dict(config.engine_kwargs), dict(config.deployment_config))
        deployment = serve.deployment(ModelServer, name=f"tokenloom:{model_id}").options(**config.deployment_config)
        servers[model_id] = deployment.bind(config)
    ingress = serve.deployment(Router, name="tokenloom-router")
    return ingress.bind(servers)


def app_builder(args: dict[str, Any]) -> Any:
    """Ray Serve's application builder (``import_path: tokenloom.ray_serve:app_builder``):
    ``args["models"]`` is a list of :class:`ModelConfig` fields."""
    models = args.get("models") if isinstance(args, dict) else None
    if not isinstance(models, list) or not all(isinstance(model, dict) for model in models):
        raise ConfigError(
            "tokenloom.ray_serve:app_builder takes args {models: [{model: ..., model_id: ..., engine_kwargs: {...}, "
            "deployment_config: {...}}, ...]}",
            param="models",
        )
    try:
        return build_openai_app([ModelConfig(**model) for model in models])
    except TypeError as exc:  # an unknown field
        raise ConfigError(f"a model of tokenloom.ray_serve:app_builder's args: {exc}", param="models") from None
