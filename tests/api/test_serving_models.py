"""The served models over HTTP with a fake engine: --lora-modules in both forms, adapters
listed with their parent and passed to the engine by the request's ``model``, unknown names a
404, the runtime load/unload routes only with VLLM_ALLOW_RUNTIME_LORA_UPDATING and behind the
API key, their errors OpenAI-shaped, and the lora_requests_info gauge."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.api.conftest import client_for
from tests.api.fake_engine import FakeEngine
from tokenloom.api.metrics import EngineStatsCollector
from tokenloom.api.serving_models import LoRAModulePath, parse_lora_modules
from tokenloom.errors import ConfigError
from tokenloom.lora.peft import LoRAAdapterError

pytestmark = pytest.mark.anyio


class LoRAFakeEngine(FakeEngine):
    """The fake engine with AsyncLLM's LoRA methods; a path containing "bad" is refused."""

    def __init__(self, *args, enable_lora=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.lora_enabled = enable_lora
        self.lora_seen: dict[str, object] = {}
        self.removed: list[int] = []

    def resolve_lora(self, lora_request):
        if "bad" in lora_request.lora_path:
            raise LoRAAdapterError(f"LoRA adapter {lora_request.lora_path} has rank 64, more than --max-lora-rank 16")
        return lora_request

    async def add_lora(self, lora_request):
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
    stats = SimpleNamespace(
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
