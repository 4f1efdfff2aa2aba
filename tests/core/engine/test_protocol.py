"""The engine-server boundary: every engine the server may be given has every member of
:class:`EngineClient` (mypy checks AsyncLLM and the data-parallel client through
``build_engine_client``'s return type; this checks the tests' fakes too, which mypy does not
read), the server reads an engine by those members alone (no ``getattr`` with a fallback),
and the factory chooses the client by ``data_parallel_size``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.api.fake_engine import FakeEngine
from tests.api.test_serving_pooling import FakePoolingEngine
from tokenloom.core.config import EngineArgs
from tokenloom.core.engine import AsyncLLM, EngineClient
from tokenloom.core.engine.data_parallel import DataParallelAsyncLLM
from tokenloom.errors import ConfigError

MEMBERS = sorted(name for name in vars(EngineClient) if not name.startswith("_") and name not in ("register", "mro"))


def test_the_protocol_names_what_the_server_reads():
    assert {"generate", "encode", "abort", "stats", "is_running", "errored", "dead_reason", "tokenizer"} <= set(MEMBERS)


@pytest.mark.parametrize("client_class", [AsyncLLM, DataParallelAsyncLLM])
def test_the_engines_have_every_member(client_class):
    # errored is an instance attribute (RequestStreams sets it), the rest are on the class
    assert [name for name in MEMBERS if not hasattr(client_class, name) and name != "errored"] == []


@pytest.mark.parametrize("fake_class", [FakeEngine, FakePoolingEngine])
def test_the_fakes_have_every_member(fake_class):
    fake = fake_class(None)  # no tokenizer: only the members are looked at
    assert [name for name in MEMBERS if not hasattr(fake, name)] == []


def test_the_server_reads_no_engine_member_by_getattr():
    """A member read with ``getattr(engine, name, default)`` hides a missing one from mypy and the
    protocol: the server names each member it reads."""
    api = Path(__file__).resolve().parents[3] / "tokenloom" / "api"
    found = [
        f"{path.name}:{node.lineno}: {ast.unparse(node)}"
        for path in sorted(api.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr")
        and node.args
        and "engine" in ast.unparse(node.args[0]).split(".")[-1]
    ]
    assert found == []


def test_async_llm_alone_refuses_replicas():
    with pytest.raises(ConfigError, match="build_engine_client"):
        AsyncLLM.from_engine_args(EngineArgs(model="smollm2", data_parallel_size=2))
