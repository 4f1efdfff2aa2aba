"""``run_server``: plugins, engine, app and uvicorn on a real socket, with the start-up phases
and "ready" logged (the engine is the fake one; the lead's e2e tests use the real engine)."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import uvicorn

from tests.api.fake_engine import FakeEngine
from tokenloom.api import server as server_module
from tokenloom.api.server_config import ServerConfig
from tokenloom.plugins.manager import PluginSet, new_registries


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def restore_tokenloom_logger():
    package_logger = logging.getLogger("tokenloom")
    saved = (package_logger.level, package_logger.propagate, list(package_logger.handlers))
    yield
    package_logger.setLevel(saved[0])
    package_logger.propagate = saved[1]
    package_logger.handlers[:] = saved[2]


def test_run_server_serves_until_told_to_exit(tokenizer, monkeypatch, caplog, restore_tokenloom_logger):
    import tokenloom.core.engine as engine_module
    import tokenloom.plugins.manager as manager_module

    engine = FakeEngine(tokenizer)
    engine.is_running = False  # until the app's lifespan starts it
    loaded = {}

    def fake_load_plugins(modules=(), files=(), strict=False):
        loaded.update(modules=list(modules), files=list(files))
        return PluginSet(new_registries(), [], [])

    monkeypatch.setattr(manager_module, "load_plugins", fake_load_plugins)
    monkeypatch.setattr(engine_module, "build_engine_client", lambda engine_args, plugins: engine)
    servers = []
    original_startup = uvicorn.Server.startup

    async def recording_startup(self, sockets=None):
        servers.append(self)
        await original_startup(self, sockets)

    monkeypatch.setattr(uvicorn.Server, "startup", recording_startup)
    port = free_port()
    serve_args = SimpleNamespace(
        engine_args=SimpleNamespace(reasoning_parser=None),
        server=ServerConfig(port=port, disable_log_stats=True, plugins=["some.module"], uvicorn_log_level="warning"),
        warnings=["--foo is deprecated"],
    )
    results = {}

    def client_thread():
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (servers and servers[0].started):
            time.sleep(0.05)
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}") as http_client:
                results["health"] = http_client.get("/health").status_code
                results["completion"] = http_client.post(
                    "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}
                ).json()
        finally:
            if servers:
                servers[0].should_exit = True

    caplog.set_level(logging.INFO, logger="tokenloom")
    thread = threading.Thread(target=client_thread)
    thread.start()
    server_module.run_server(serve_args)
    thread.join(timeout=30)

    assert results["health"] == 200
    assert results["completion"]["choices"][0]["text"] == " The quick"
    assert loaded == {"modules": ["some.module"], "files": []}
    assert engine.started and engine.shut_down
    messages = [record.getMessage() for record in caplog.records]
    assert "--foo is deprecated" in messages
    for phase in (
        "importing the engine (torch, transformers): done in",
        "loading plugins: done in",
        "importing the server (fastapi), while the engine builds: done in",
        "building the engine: done in",
        "building the app: done in",
    ):
        assert any(message.startswith(phase) for message in messages), phase
    ready = [
        message for message in messages if message.startswith(f"ready: serving smollm2 at http://127.0.0.1:{port}")
    ]
    assert len(ready) == 1 and ready[0].endswith("since the process started)")


def test_seconds_since_process_start_counts_from_the_process_start():
    code = (
        "import time; time.sleep(0.5); from tokenloom.api.server import seconds_since_process_start; "
        "print(seconds_since_process_start())"
    )
    started = time.monotonic()
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    elapsed = time.monotonic() - started
    # /proc counts in clock ticks (10 ms)
    assert 0.5 <= float(output) <= elapsed + 0.02


def test_plugins_the_cli_loaded_are_reported_with_the_time_it_took(monkeypatch, caplog, restore_tokenloom_logger):
    import tokenloom.core.engine as engine_module

    class Stop(Exception):
        pass

    def refuse(engine_args, plugins):
        raise Stop

    monkeypatch.setattr(engine_module, "build_engine_client", refuse)
    caplog.set_level(logging.INFO, logger="tokenloom")
    serve_args = SimpleNamespace(
        engine_args=SimpleNamespace(reasoning_parser=None),
        server=ServerConfig(uvicorn_log_level="warning"),
        plugins=PluginSet(new_registries(), [], []),
        plugins_load_seconds=0.25,
    )
    with pytest.raises(Stop):
        server_module.run_server(serve_args)
    messages = [record.getMessage() for record in caplog.records]
    assert "loading plugins: done in 0.25 s, before the flags were checked" in messages
    assert messages[0].startswith("before the server: ") and messages[0].endswith(
        "since the process started (interpreter, command line, plugins)"
    )
