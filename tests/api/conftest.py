"""Fixtures for the HTTP layer: SmolLM2's real tokenizer (built once per session from the
GGUF file), a fake engine around it, and apps built with ``build_app``."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.api.fake_engine import FakeEngine
from tokenloom.api.app import build_app
from tokenloom.api.server_config import ServerConfig


@pytest.fixture(scope="session")
def tokenizer(smollm2_gguf):
    # the server's own loader: the tokenizer `tokenloom serve smollm2` uses, identical to
    # transformers' (tests/builtin_plugins/loaders/test_gguf_real_models.py) and built in well
    # under a second where transformers' GGUF conversion takes tens
    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat

    return GGUFLoadFormat().load_tokenizer(smollm2_gguf, None)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def engine(tokenizer):
    return FakeEngine(tokenizer, served_model_names=["smollm2", "smol-alias"])


@pytest.fixture
def make_app(engine, monkeypatch):
    monkeypatch.delenv("TOKENLOOM_API_KEY", raising=False)

    def factory(engine=engine, plugins=None, reasoning_parser=None, **config_fields):
        config_fields.setdefault("disable_log_stats", True)
        return build_app(engine, plugins, ServerConfig(**config_fields), reasoning_parser=reasoning_parser)

    return factory


def client_for(app, **kwargs) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", **kwargs)


@pytest.fixture
async def client(make_app):
    async with client_for(make_app()) as http_client:
        yield http_client


def sse_events(body: str) -> list:
    """The JSON payloads of an SSE body, with the final ``[DONE]`` checked and removed."""
    blocks = [block for block in body.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in blocks), blocks
    assert blocks[-1] == "data: [DONE]"
    return [json.loads(block[len("data: ") :]) for block in blocks[:-1]]
