"""``run_server(serve_args)``: what ``tokenloom serve`` runs. Configures logging, loads the
plugins, builds the engine and the app, and serves them with uvicorn, logging each start-up
phase with its duration and "ready" once the socket accepts requests, with the time since the
process started (what a user waits for)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tokenloom.api.serve_args import LOGGING_LEVEL_ENV

if TYPE_CHECKING:
    import socket

    import uvicorn

    from tokenloom.api.serve_args import ServeArgs
    from tokenloom.api.server_config import ServerConfig

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(uvicorn_log_level: str) -> None:
    """tokenloom's loggers print to stderr (unless the host application configured logging
    already) at INFO, DEBUG when uvicorn logs at debug/trace, or $TOKENLOOM_LOGGING_LEVEL:
    start-up phases, "ready" and the stats line stay visible when uvicorn is quieter."""
    default = "DEBUG" if uvicorn_log_level.lower() in ("debug", "trace") else "INFO"
    level_name = os.environ.get(LOGGING_LEVEL_ENV, default).upper()
    package_logger = logging.getLogger("tokenloom")
    package_logger.setLevel(getattr(logging, level_name, logging.INFO))
    if not logging.getLogger().handlers and not package_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        package_logger.addHandler(handler)
        package_logger.propagate = False


@contextlib.contextmanager
def startup_phase(name: str) -> Iterator[None]:
    logger.info("%s ...", name)
    start = time.perf_counter()
    yield
    logger.info("%s: done in %.2f s", name, time.perf_counter() - start)


def seconds_since_process_start() -> float | None:
    """How long this process has been running (to 10 ms), from Linux's /proc; None elsewhere."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            # the command name, field 2, may hold spaces; field 22 (start time in clock ticks
            # after boot) is the 20th after its closing parenthesis
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as uptime:
            seconds_since_boot = float(uptime.read().split()[0])
        return max(0.0, seconds_since_boot - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _since_start() -> str:
    seconds = seconds_since_process_start()
    return "" if seconds is None else f" ({seconds:.2f} s since the process started)"


def uvicorn_config(app: Any, server: ServerConfig) -> uvicorn.Config:
    import uvicorn

    return uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        log_level=server.uvicorn_log_level,
        ssl_keyfile=server.ssl_keyfile,
        ssl_certfile=server.ssl_certfile,
        ssl_ca_certs=server.ssl_ca_certs,
        ssl_cert_reqs=server.ssl_cert_reqs,
        root_path=server.root_path or "",
        access_log=not server.disable_uvicorn_access_log,
        timeout_keep_alive=5,
    )


# The engine thread and the event loop share the GIL: each torch op releases it, and getting
# it back waits up to this long while the loop runs Python (default 5 ms); the value chosen and
# its measurement: docs/design.md, "AsyncLLM".
GIL_SWITCH_INTERVAL_SECONDS = 0.0005
# how long a --headless node's replicas wait for the head node's server to answer
HEADLESS_CONNECT_TIMEOUT_SECONDS = 900.0


def run_server(serve_args: ServeArgs) -> None:
    """Blocks until the server stops (Ctrl-C or SIGTERM)."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_SECONDS)
    server = serve_args.server
    configure_logging(server.uvicorn_log_level)
    started = seconds_since_process_start()
    if started is not None:
        logger.info("before the server: %.2f s since the process started (interpreter, command line, plugins)", started)
    for warning in getattr(serve_args, "warnings", None) or []:
        logger.warning(warning)
    if server.headless:
        _run_headless(serve_args)
        return
    asyncio.run(_serve(serve_args))


def _run_headless(serve_args: ServeArgs) -> None:
    """``--headless``: this node's share of a head node's engines: its data-parallel replicas
    (``-dp``), or its workers of node 0's engine (``--nnodes``, run by the executor plugin)."""
    from tokenloom.core.engine.engine_setup import choose_executor
    from tokenloom.core.engine.remote_replicas import run_headless
    from tokenloom.plugins.manager import load_plugins

    server = serve_args.server
    plugins = getattr(serve_args, "plugins", None) or load_plugins(
        modules=server.plugins, files=server.tool_parser_plugin, strict=server.strict_plugins
    )
    config = serve_args.engine_args.create_engine_config()
    if config.parallel.nnodes > 1:
        executor_class = plugins.registry("executor").get(choose_executor(config.parallel))
        code = executor_class.run_node(config, timeout=HEADLESS_CONNECT_TIMEOUT_SECONDS)
    else:
        code = run_headless(serve_args.engine_args, plugins, timeout=HEADLESS_CONNECT_TIMEOUT_SECONDS)
    if code:
        raise SystemExit(code)


async def _serve(serve_args: ServeArgs) -> None:
    # one event loop for the engine and uvicorn: the engine's asyncio objects belong to it.
    # The engine's modules first, and transformers' tokenizer classes with them, though the
    # engine imports those only when it loads the tokenizer: imported there, they took turns on
    # the GIL with the server's import running beside the build (both are Python), and the
    # weights' packing after them (torch ops, which release it) ran alone. Imported here, the
    # server's import runs beside the packing: a 1.7B GGUF's start-up to ready 3.31-3.49 s ->
    # 3.24-3.38 s (2 cores, alternated)
    with startup_phase("importing the engine (torch, transformers)"):
        import transformers.tokenization_utils_fast  # noqa: F401

        from tokenloom.core.engine import build_engine_client
        from tokenloom.plugins.manager import load_plugins

    server = serve_args.server
    plugins = getattr(serve_args, "plugins", None)
    if plugins is not None:  # the CLI loaded them, to check the flags' choices
        seconds = getattr(serve_args, "plugins_load_seconds", None)
        logger.info(
            "loading plugins: done %s",
            "before the flags were checked"
            if seconds is None
            else f"in {seconds:.2f} s, before the flags were checked",
        )
    else:
        with startup_phase("loading plugins"):
            plugins = load_plugins(
                modules=server.plugins, files=server.tool_parser_plugin, strict=server.strict_plugins
            )
    for failure in plugins.failures:
        logger.warning("plugin %r (%s) was not loaded: %s", failure.name, failure.origin, failure.cause)
    with startup_phase("building the engine"):
        # the engine builds on its own thread, mostly in torch ops that release the GIL: this
        # thread imports the server (fastapi, the protocol models) meanwhile instead of before
        building = asyncio.get_running_loop().run_in_executor(
            None, build_engine_client, serve_args.engine_args, plugins
        )
        try:
            with startup_phase("importing the server (fastapi), while the engine builds"):
                import uvicorn

                from tokenloom.api.app import build_app
        finally:
            engine = await building  # a build error is raised here, before an import error
    try:
        with startup_phase("building the app"):
            app = build_app(engine, plugins, server, reasoning_parser=serve_args.engine_args.reasoning_parser)
        scheme = "https" if server.ssl_certfile else "http"
        address = f"{scheme}://{server.host}:{server.port}{server.root_path or ''}"

        class _Server(uvicorn.Server):
            async def startup(self, sockets: list[socket.socket] | None = None) -> None:
                started_at = time.perf_counter()
                await super().startup(sockets)
                if self.started:
                    logger.info("starting the engine and listening: done in %.2f s", time.perf_counter() - started_at)
                    logger.info(
                        "ready: serving %s at %s%s",
                        ", ".join(app.state.serving.served_model_names),
                        address,
                        _since_start(),
                    )

        await _Server(uvicorn_config(app, server)).serve()
    finally:
        # the app's lifespan shuts the engine down; this covers a failure before it ran
        if engine.is_running:
            await engine.shutdown()
