"""The served models over HTTP with a fake engine: --lora-modules in both forms, adapters
listed with their parent and passed to the engine by the request's ``model``, unknown names a
404, the runtime load/unload routes only with VLLM_ALLOW_RUNTIME_LORA_UPDATING and behind the
API key, their errors OpenAI-shaped, and the lora_requests_info gauge."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tests.api.conftest import client_for
from tests.api.fake_engine import FakeEngine
from tokenloom.api.metrics import EngineStatsCollector
from tokenloom.api.serving_models import LoRAModulePath, parse_lora_modules
from tokenloom.core.config import LoRAConfig
from tokenloom.core.engine.engine_stats import EngineStats
from tokenloom.errors import ConfigError
from tokenloom.lora.peft import LoRAAdapterError

pytestmark = pytest.mark.anyio


class LoRAFakeEngine(FakeEngine):
    """The fake engine with AsyncLLM's LoRA methods; a path containing "bad" is refused."""

    def __init__(self, *args, enable_lora=True, max_loras=4, max_cpu_loras=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lora_config = LoRAConfig(enable_lora=enable_lora, max_loras=max_loras, max_cpu_loras=max_cpu_loras)
        self.lora_seen: dict[str, object] = {}
        self.removed: list[int] = []
        self.added: list[object] = []
        self.resolved: list[object] = []
        self.add_gate: asyncio.Event | None = None  # when set, add_lora waits for it

    def resolve_lora(self, lora_request):
        self.resolved.append(lora_request)
        if "bad" in lora_request.lora_path:
            raise LoRAAdapterError(f"LoRA adapter {lora_request.lora_path} has rank 64, more than --max-lora-rank 16")
        return lora_request

    async def add_lora(self, lora_request):
        self.added.append(lora_request)
        if self.add_gate is not None:
            await self.add_gate.wait()
        self.resolve_lora(lora_request)
        return True

    async def remove_lora(self, lora_int_id):
        self.removed.append(lora_int_id)
        return True

    async def generate(self, prompt, sampling_params, request_id, *, priority=0, lora_request=None):
        self.lora_seen[request_id] = lora_request
        async for output in super().generate(prompt, sampling_params, request_id, priority=priority):
            yield output


@pytest.fixture
def lora_engine(tokenizer):
    return LoRAFakeEngine(tokenizer, served_model_names=["smollm2", "smol-alias"])


def test_parse_lora_modules_both_forms():
    assert parse_lora_modules(["sql=/a/sql", '{"name": "chat", "path": "org/chat", "base_model_name": "smollm2"}']) == [
        LoRAModulePath("sql", "/a/sql"),
        LoRAModulePath("chat", "org/chat", "smollm2"),
    ]
    for bad, message in [
        (["sql"], "neither name=path nor a JSON object"),
        (['{"name": "x"}'], 'needs string "name" and "path"'),
        (['{"name": "x", "path": "p", "rank": 8}'], r"unknown keys \['rank'\]"),
        (["{not json"], "is not valid JSON"),
        (["a=/x", "a=/y"], "names a more than once"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_lora_modules(bad)


async def test_adapters_are_listed_and_picked_by_model(make_app, lora_engine):
    app = make_app(engine=lora_engine, lora_modules=["sql=/adapters/sql"])
    async with client_for(app) as client:
        cards = {card["id"]: card for card in (await client.get("/v1/models")).json()["data"]}
        assert set(cards) == {"smollm2", "smol-alias", "sql"}
        assert cards["sql"]["parent"] == "smollm2" and cards["sql"]["root"] == "/adapters/sql"
        assert cards["smollm2"]["parent"] is None
        response = await client.post("/v1/completions", json={"model": "sql", "prompt": "Hi", "max_tokens": 3})
        assert response.status_code == 200 and response.json()["model"] == "sql"
        response = await client.post(
            "/v1/chat/completions",
            json={"model": "sql", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        )
        assert response.status_code == 200
        base = await client.post("/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 3})
        assert base.status_code == 200
        missing = await client.post("/v1/completions", json={"model": "nope", "prompt": "Hi", "max_tokens": 3})
        assert missing.status_code == 404
        assert "'nope' does not exist" in missing.json()["error"]["message"]
        assert "'sql'" in missing.json()["error"]["message"]
    seen = list(lora_engine.lora_seen.values())
    assert [request.lora_name if request else None for request in seen] == ["sql", "sql", None]
    assert seen[0].lora_int_id == seen[1].lora_int_id == 1


async def test_runtime_routes_only_when_allowed(make_app, lora_engine, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.delenv("TOKENLOOM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    async with client_for(make_app(engine=lora_engine)) as client:
        response = await client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
        assert response.status_code == 404


@pytest.mark.parametrize("variable", ["VLLM_ALLOW_RUNTIME_LORA_UPDATING", "TOKENLOOM_ALLOW_RUNTIME_LORA_UPDATING"])
async def test_runtime_load_and_unload(make_app, lora_engine, monkeypatch, variable):
    monkeypatch.setenv(variable, "True")
    app = make_app(engine=lora_engine, api_key=["secret"])
    async with client_for(app) as client:
        body = {"lora_name": "live", "lora_path": "/adapters/live"}
        assert (await client.post("/v1/load_lora_adapter", json=body)).status_code == 401
        auth = {"Authorization": "Bearer secret"}
        loaded = await client.post("/v1/load_lora_adapter", json=body, headers=auth)
        assert loaded.status_code == 200 and "live" in loaded.text
        again = await client.post("/v1/load_lora_adapter", json=body, headers=auth)
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        bad = await client.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/bad"}, headers=auth)
        assert bad.status_code == 400 and "--max-lora-rank 16" in bad.json()["error"]["message"]
        models = (await client.get("/v1/models", headers=auth)).json()["data"]
        assert [card["id"] for card in models] == ["smollm2", "smol-alias", "live"]
        done = await client.post("/v1/unload_lora_adapter", json={"lora_name": "live"}, headers=auth)
        assert done.status_code == 200
        assert lora_engine.removed == [1]
        gone = await client.post("/v1/unload_lora_adapter", json={"lora_name": "live"}, headers=auth)
        assert gone.status_code == 404 and gone.json()["error"]["type"]
        used = await client.post("/v1/completions", json={"model": "live", "prompt": "Hi"}, headers=auth)
        assert used.status_code == 404
        # a new load of the same name is a new adapter id (no stale prefix cache)
        await client.post("/v1/load_lora_adapter", json=body, headers=auth)
        await client.post("/v1/completions", json={"model": "live", "prompt": "Hi", "max_tokens": 2}, headers=auth)
        assert list(lora_engine.lora_seen.values())[-1].lora_int_id == 3


async def test_runtime_load_needs_enable_lora(make_app, tokenizer, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    async with client_for(make_app(engine=LoRAFakeEngine(tokenizer, enable_lora=False))) as client:
        response = await client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
        assert response.status_code == 400 and "--enable-lora" in response.json()["error"]["message"]


def test_lora_modules_need_enable_lora_and_good_adapters(make_app, tokenizer):
    with pytest.raises(ConfigError, match="--lora-modules needs --enable-lora"):
        make_app(engine=LoRAFakeEngine(tokenizer, enable_lora=False), lora_modules=["a=/a"])
    with pytest.raises(LoRAAdapterError, match="more than --max-lora-rank"):
        make_app(engine=LoRAFakeEngine(tokenizer), lora_modules=["a=/bad"])
    with pytest.raises(Exception, match="is for base model 'other'"):
        make_app(
            engine=LoRAFakeEngine(tokenizer), lora_modules=['{"name": "a", "path": "/a", "base_model_name": "other"}']
        )


def test_lora_requests_info_gauge():
    stats = EngineStats(
        num_running=1,
        num_waiting=2,
        kv_cache_usage=0.5,
        prompt_tokens_total=0,
        generation_tokens_total=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
        running_lora_adapters=["chat", "sql"],
        waiting_lora_adapters=["x"],
        max_lora=4,
    )
    families = {
        family.name: family for family in EngineStatsCollector(SimpleNamespace(stats=lambda: stats), "m").collect()
    }
    [sample] = families["vllm:lora_requests_info"].samples
    assert sample.labels == {"max_lora": "4", "waiting_lora_adapters": "x", "running_lora_adapters": "chat,sql"}
    stats.max_lora = 0
    families = {family.name for family in EngineStatsCollector(SimpleNamespace(stats=lambda: stats), "m").collect()}
    assert "vllm:lora_requests_info" not in families


# -- loading edges (issue 37, item 11) -------------------------------------------------------------


async def test_two_concurrent_loads_of_one_name_reach_the_engine_once(make_app, lora_engine, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    lora_engine.add_gate = asyncio.Event()
    async with client_for(make_app(engine=lora_engine)) as client:
        body = {"lora_name": "twin", "lora_path": "/adapters/twin"}
        first = asyncio.ensure_future(client.post("/v1/load_lora_adapter", json=body))
        while not lora_engine.added:
            await asyncio.sleep(0.01)
        second = await client.post("/v1/load_lora_adapter", json=body)
        assert second.status_code == 400 and "'twin' is being loaded" in second.json()["error"]["message"]
        lora_engine.add_gate.set()
        assert (await first).status_code == 200
    assert [request.lora_name for request in lora_engine.added] == ["twin"]  # no orphan in the engine


async def test_a_failed_load_leaves_its_name_free(make_app, lora_engine, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    async with client_for(make_app(engine=lora_engine)) as client:
        bad = await client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/bad"})
        assert bad.status_code == 400
        good = await client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/good"})
        assert good.status_code == 200


async def test_runtime_loads_are_bounded_by_max_cpu_loras(make_app, tokenizer, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    engine = LoRAFakeEngine(tokenizer, max_loras=1, max_cpu_loras=3)
    async with client_for(make_app(engine=engine, lora_modules=["static=/adapters/static"])) as client:
        for name in ("a", "b"):
            loaded = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": f"/{name}"})
            assert loaded.status_code == 200
        refused = await client.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": "/c"})
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["code"] == "lora_adapter_limit"
        assert "at most 3 LoRA adapters (--max-cpu-loras)" in error["message"]
        assert "unload one with POST /v1/unload_lora_adapter" in error["message"]
        assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})).status_code == 200
        again = await client.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": "/c"})
        assert again.status_code == 200
    assert [request.lora_name for request in engine.added] == ["a", "b", "c"]


async def test_the_default_bound_is_max_loras_or_the_static_adapters(make_app, tokenizer, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    engine = LoRAFakeEngine(tokenizer, max_loras=1)
    app = make_app(engine=engine, lora_modules=["s1=/s1", "s2=/s2"])  # more than --max-loras: allowed
    async with client_for(app) as client:
        refused = await client.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": "/c"})
        assert refused.status_code == 400 and "at most 2 LoRA adapters" in refused.json()["error"]["message"]
    with pytest.raises(ConfigError, match="--lora-modules names 2 adapters, more than --max-cpu-loras 1"):
        make_app(engine=LoRAFakeEngine(tokenizer, max_loras=1, max_cpu_loras=1), lora_modules=["s1=/s1", "s2=/s2"])


@pytest.mark.parametrize("allowed", [False, True])
async def test_runtime_loads_may_name_a_hub_repo_only_when_allowed(make_app, lora_engine, monkeypatch, allowed):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    if allowed:
        monkeypatch.setenv("TOKENLOOM_ALLOW_RUNTIME_LORA_HUB", "true")
    else:
        monkeypatch.delenv("TOKENLOOM_ALLOW_RUNTIME_LORA_HUB", raising=False)
    app = make_app(engine=lora_engine, lora_modules=["static=org/static"])
    async with client_for(app) as client:
        body = {"lora_name": "hub", "lora_path": "org/adapter"}
        assert (await client.post("/v1/load_lora_adapter", json=body)).status_code == 200
    (runtime,) = lora_engine.added
    assert runtime.allow_hub is allowed
    assert lora_engine.resolved[0].lora_name == "static" and lora_engine.resolved[0].allow_hub  # the operator's
