"""The assembled app: the non-generation routes, error shapes for unknown routes and
methods, docs and root_path options, plugin routes, the lifespan, Prometheus metrics, and
the official ``openai`` client talking to the app."""

from __future__ import annotations

import asyncio
import logging

import httpx
import openai
import pytest
from fastapi import APIRouter
from fastapi.testclient import TestClient

from tests.api.conftest import client_for
from tests.api.fake_engine import FakeStats
from tokenloom import __version__
from tokenloom.api.metrics import format_stats_line, log_stats_periodically
from tokenloom.errors import PluginError
from tokenloom.plugins.manager import PluginSet, new_registries

pytestmark = pytest.mark.anyio


async def test_models_lists_every_served_name(client, engine):
    body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    assert [card["id"] for card in body["data"]] == ["smollm2", "smol-alias"]
    assert all(card["object"] == "model" and card["max_model_len"] == engine.max_model_len for card in body["data"])


async def test_tokenize_prompt_and_chat(client, tokenizer):
    response = await client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    body = response.json()
    assert body["tokens"] == tokenizer("Hello world")["input_ids"]
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    chat = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})).json()
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat["tokens"] == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert (await client.post("/tokenize", json={})).status_code == 400


async def test_detokenize(client, tokenizer):
    ids = tokenizer("Hello world")["input_ids"]
    assert (await client.post("/detokenize", json={"tokens": ids})).json() == {"prompt": "Hello world"}
    bad = await client.post("/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    unknown_model = await client.post("/detokenize", json={"tokens": ids, "model": "nope"})
    assert unknown_model.status_code == 404


async def test_health_ping_version(client, engine):
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/ping")).status_code == 200
    assert (await client.post("/ping")).status_code == 200
    assert (await client.get("/version")).json() == {"version": __version__}
    engine.errored = True
    dead = await client.get("/health")
    assert dead.status_code == 503 and dead.json()["error"]["type"] == "ServiceUnavailableError"
    engine.dead_reason = "the engine's worker 1 (pid 7) was killed by SIGKILL"  # the cause, when known
    dead = await client.get("/health")
    assert (
        dead.status_code == 503
        and "(the engine's worker 1 (pid 7) was killed by SIGKILL)" in dead.json()["error"]["message"]
    )


async def test_unknown_routes_and_methods_use_the_error_shape(client):
    missing = await client.get("/v1/nothing")
    assert missing.status_code == 404
    assert set(missing.json()["error"]) == {"message", "type", "param", "code"}
    wrong_method = await client.get("/v1/completions")
    assert wrong_method.status_code == 405
    assert "GET" in wrong_method.json()["error"]["message"]


async def test_docs_can_be_disabled(make_app):
    async with client_for(make_app()) as http_client:
        assert (await http_client.get("/openapi.json")).status_code == 200
    async with client_for(make_app(disable_fastapi_docs=True)) as http_client:
        assert (await http_client.get("/openapi.json")).status_code == 404
        assert (await http_client.get("/docs")).status_code == 404


async def test_root_path_behind_a_proxy(make_app):
    app = make_app(api_key=["k"])
    # uvicorn's --root-path puts the prefix in the scope; the proxy may or may not strip it
    transport = httpx.ASGITransport(app=app, root_path="/llm")
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http_client:
        for path in ("/v1/models", "/llm/v1/models"):
            assert (await http_client.get(path, headers={"Authorization": "Bearer k"})).status_code == 200
        # a public route stays public behind the prefix
        for path in ("/health", "/llm/health"):
            assert (await http_client.get(path)).status_code == 200
        assert (await http_client.get("/llm/v1/models")).status_code == 401


def test_uvicorn_gets_the_server_options():
    from tokenloom.api.server import uvicorn_config
    from tokenloom.api.server_config import ServerConfig

    options = ServerConfig(
        host="0.0.0.0",
        port=9001,
        root_path="/llm",
        ssl_keyfile="k.pem",
        ssl_certfile="c.pem",
        uvicorn_log_level="warning",
    )
    config = uvicorn_config(object(), options)
    assert (config.host, config.port, config.root_path) == ("0.0.0.0", 9001, "/llm")
    assert (config.ssl_keyfile, config.ssl_certfile, config.log_level) == ("k.pem", "c.pem", "warning")


def add_echo_route(app, engine):
    router = APIRouter()

    @router.get("/plugin/model")
    async def which_model():
        return {"model": engine.model_name}

    app.include_router(router)


async def test_plugin_routes_from_the_registry(make_app):
    registries = new_registries()
    registries["api_route"].register("echo", add_echo_route, plugin_name="tests")
    async with client_for(make_app(plugins=PluginSet(registries, [], []))) as http_client:
        assert (await http_client.get("/plugin/model")).json() == {"model": "smollm2"}


def add_status_routes(app, engine):
    router = APIRouter()

    @router.get("/plugin/status")
    async def status():
        return {"ok": True}

    @router.get("/plugin/private")
    async def private():
        return {"secret": True}

    @router.get("/v1/models")  # taken by the built-in route: never reached
    async def shadowed_models():
        return {"plugin": True}

    app.include_router(router)


async def test_plugin_routes_need_the_api_key_unless_declared_public_and_shadowing_is_warned(make_app, caplog):
    registries = new_registries()
    registries["api_route"].register(
        "status", add_status_routes, plugin_name="status_plugin", public_paths=["/plugin/status"]
    )
    with caplog.at_level("WARNING", logger="tokenloom.api.app"):
        app = make_app(plugins=PluginSet(registries, [], []), api_key=["sekret"])
    [warning] = [record.getMessage() for record in caplog.records if "unreachable" in record.getMessage()]
    assert warning.startswith(
        "plugin 'status_plugin' (API routes 'status') adds GET /v1/models, which is already served"
    )
    async with client_for(app) as http_client:
        assert (await http_client.get("/plugin/status")).json() == {"ok": True}
        assert (await http_client.get("/plugin/private")).status_code == 401
        authorized = {"Authorization": "Bearer sekret"}
        assert (await http_client.get("/plugin/private", headers=authorized)).json() == {"secret": True}
        assert "plugin" not in (await http_client.get("/v1/models", headers=authorized)).json()


def test_public_paths_must_be_a_list_of_paths(make_app):
    registries = new_registries()
    registries["api_route"].register(
        "status", add_status_routes, plugin_name="status_plugin", public_paths="/plugin/status"
    )
    with pytest.raises(PluginError, match="public_paths='/plugin/status': expected a list of paths"):
        make_app(plugins=PluginSet(registries, [], []))


def test_lifespan_starts_and_shuts_down_the_engine(make_app, engine):
    engine.is_running = False
    with TestClient(make_app()) as test_client:
        assert engine.started
        assert test_client.get("/health").status_code == 200
    assert engine.shut_down


def test_health_is_503_before_the_engine_starts(make_app, engine):
    engine.is_running = False
    app = make_app()

    async def check():
        async with client_for(app) as http_client:
            return await http_client.get("/health")

    assert asyncio.run(check()).status_code == 503


# -- metrics -------------------------------------------------------------------------------

METRIC_NAMES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_success_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
]


def metric_value(text: str, prefix: str) -> float:
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{prefix} not in metrics")


async def test_metrics_names_and_values(client, engine):
    engine.counters.num_running = 3
    await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
    await client.post("/v1/completions", json={"prompt": "Hi", "stop": [" quick"], "max_tokens": 9})
    response = await client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in METRIC_NAMES:
        assert name in text, name
    assert metric_value(text, 'vllm:num_requests_running{model_name="smollm2"}') == 3
    assert metric_value(text, 'vllm:kv_cache_usage_perc{model_name="smollm2"}') == 0.25
    assert metric_value(text, 'vllm:mm_cache_queries_total{model_name="smollm2"}') == 5
    assert metric_value(text, 'vllm:mm_cache_hits_total{model_name="smollm2"}') == 3
    assert metric_value(text, 'vllm:request_success_total{finished_reason="length",model_name="smollm2"}') == 1
    assert metric_value(text, 'vllm:request_success_total{finished_reason="stop",model_name="smollm2"}') == 1
    assert metric_value(text, 'vllm:time_to_first_token_seconds_count{model_name="smollm2"}') == 2
    # 4 + 2 tokens: an inter-token gap after each but the first
    assert metric_value(text, 'vllm:inter_token_latency_seconds_count{model_name="smollm2"}') == 4
    assert (
        metric_value(text, 'vllm:generation_tokens_total{model_name="smollm2"}')
        == engine.counters.generation_tokens_total
    )


async def test_finish_reasons_of_choices_that_end_at_different_steps(client):
    # with n=2, output 0 stops early on " quick" while output 1 runs to max_tokens
    await client.post("/v1/completions", json={"prompt": "Hi", "n": 2, "stop": [" quick"], "max_tokens": 4})
    text = (await client.get("/metrics")).text
    assert metric_value(text, 'vllm:request_success_total{finished_reason="stop",model_name="smollm2"}') == 1
    assert metric_value(text, 'vllm:request_success_total{finished_reason="length",model_name="smollm2"}') == 1


async def test_each_app_has_its_own_registry(make_app, client):
    await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    async with client_for(make_app()) as other:
        text = (await other.get("/metrics")).text
    assert metric_value(text, 'vllm:e2e_request_latency_seconds_count{model_name="smollm2"}') == 0


async def test_metrics_survive_a_dead_engine(client, engine):
    def broken():
        raise RuntimeError("engine gone")

    engine.stats = broken
    response = await client.get("/metrics")
    assert response.status_code == 200 and "vllm:time_to_first_token_seconds" in response.text


def test_stats_line():
    previous = (100, 50)
    stats = FakeStats(
        num_running=2,
        num_waiting=1,
        kv_cache_usage=0.5,
        prefix_cache_queries=10,
        prefix_cache_hits=4,
        prompt_tokens_total=300,
        generation_tokens_total=150,
    )
    line = format_stats_line(stats, previous, 10.0)
    assert line == (
        "prompt throughput: 20.0 tokens/s, generation throughput: 10.0 tokens/s, running: 2 reqs, "
        "waiting: 1 reqs, KV cache usage: 50.0%, prefix cache hit rate: 40.0%"
    )


def test_stats_line_with_speculative_decoding():
    from tokenloom.core.scheduler_stats import SpecDecodingStats

    previous_spec = SpecDecodingStats(3, num_drafts=10, num_draft_tokens=30, num_accepted_tokens=12)
    # since then: 10 drafts of 30 tokens, 18 accepted
    spec = SpecDecodingStats(3, num_drafts=20, num_draft_tokens=60, num_accepted_tokens=30)
    stats = FakeStats(prompt_tokens_total=0, generation_tokens_total=0, spec_decoding=spec)
    line = format_stats_line(stats, (0, 0), 1.0, previous_spec)
    assert line.endswith(
        ", spec decode draft acceptance rate: 60.0%, mean acceptance length: 2.80 (18 of 30 draft tokens accepted)"
    )
    assert "acceptance rate: 50.0%" in format_stats_line(stats, None, 1.0)  # since start


async def test_spec_decoding_metrics_under_vllm_names(client, engine):
    from tokenloom.core.scheduler_stats import SpecDecodingStats

    spec = SpecDecodingStats(2, num_drafts=5, num_draft_tokens=9, num_accepted_tokens=6)
    spec.num_accepted_tokens_per_pos = [4, 2]
    engine.stats = lambda: FakeStats(spec_decoding=spec)
    text = (await client.get("/metrics")).text
    assert metric_value(text, 'vllm:spec_decode_num_drafts_total{model_name="smollm2"}') == 5
    assert metric_value(text, 'vllm:spec_decode_num_draft_tokens_total{model_name="smollm2"}') == 9
    assert metric_value(text, 'vllm:spec_decode_num_accepted_tokens_total{model_name="smollm2"}') == 6
    per_position = 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="smollm2",position='
    assert metric_value(text, per_position + '"0"}') == 4
    assert metric_value(text, per_position + '"1"}') == 2


def test_no_spec_decoding_metrics_without_speculation():
    stats = FakeStats(prompt_tokens_total=0, generation_tokens_total=0)
    assert "spec decode" not in format_stats_line(stats, None, 1.0)


async def test_periodic_stats_log(engine, caplog):
    caplog.set_level(logging.INFO, logger="tokenloom.api.metrics")
    task = asyncio.ensure_future(log_stats_periodically(engine, interval_s=0.01))
    await asyncio.sleep(0.05)
    task.cancel()
    assert any("KV cache usage: 25.0%" in record.getMessage() for record in caplog.records)


# -- the official client -------------------------------------------------------------------


@pytest.fixture
async def openai_client(make_app):
    transport = httpx.ASGITransport(app=make_app(api_key=["sk-x"]))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http_client:
        yield openai.AsyncOpenAI(base_url="http://test/v1", api_key="sk-x", http_client=http_client, max_retries=0)


async def test_openai_client_completions_and_chat(openai_client):
    models = await openai_client.models.list()
    assert [model.id for model in models.data] == ["smollm2", "smol-alias"]
    completion = await openai_client.completions.create(
        model="smollm2", prompt="Hi", max_tokens=2, logprobs=1, extra_body={"top_k": 5}
    )
    assert completion.choices[0].text == " The quick"
    assert completion.choices[0].logprobs.tokens == [" The", " quick"]
    chat = await openai_client.chat.completions.create(
        model="smollm2", max_tokens=2, logprobs=True, top_logprobs=1, messages=[{"role": "user", "content": "Hi"}]
    )
    assert chat.choices[0].message.content == " The quick"
    assert chat.choices[0].logprobs.content[0].top_logprobs[0].token == " The"
    assert chat.usage.completion_tokens == 2


async def test_openai_client_streaming(openai_client):
    stream = await openai_client.chat.completions.create(
        model="smol-alias",
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Hi"}],
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " The quick brown"
    assert chunks[-1].usage.completion_tokens == 3


async def test_openai_client_errors(openai_client):
    with pytest.raises(openai.NotFoundError):
        await openai_client.completions.create(model="gpt-9", prompt="Hi")
    with pytest.raises(openai.BadRequestError) as info:
        await openai_client.completions.create(model="smollm2", prompt="Hi", suffix="x")
    assert "suffix" in info.value.message


def test_reset_prefix_cache_is_served_in_vllms_dev_mode_only(make_app, engine, monkeypatch):
    """vLLM serves POST /reset_prefix_cache only with VLLM_SERVER_DEV_MODE; so does tokenloom."""
    for name in ("VLLM_SERVER_DEV_MODE", "TOKENLOOM_SERVER_DEV_MODE"):
        monkeypatch.delenv(name, raising=False)
    with TestClient(make_app()) as test_client:
        assert test_client.post("/reset_prefix_cache").status_code == 404
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with TestClient(make_app()) as test_client:
        assert test_client.post("/reset_prefix_cache").status_code == 200
    assert engine.prefix_cache_resets == 1
