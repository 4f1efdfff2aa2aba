"""The effect of ``tokenloom serve`` flags that no other test showed: each test sets the flag's
config field and checks what changes (the catalogue rule, tests/api/test_flag_catalogue_rule.py,
names these tests as the flags' behavioural evidence)."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
from starlette.types import Receive, Scope, Send

from tests.api.conftest import client_for
from tokenloom import LLM
from tokenloom.api.middleware import ServerLoad, ServerLoadMiddleware
from tokenloom.api.server import uvicorn_config
from tokenloom.api.server_config import ServerConfig
from tokenloom.core.config import EngineArgs
from tokenloom.errors import ConfigError, UnknownNameError

pytestmark = pytest.mark.anyio


# -- the HTTP front end ----------------------------------------------------------------------


def test_uvicorn_gets_the_client_certificate_options_and_the_access_log_switch():
    options = ServerConfig(ssl_ca_certs="ca.pem", ssl_cert_reqs=2, disable_uvicorn_access_log=True)
    config = uvicorn_config(object(), options)
    assert (config.ssl_ca_certs, config.ssl_cert_reqs, config.access_log) == ("ca.pem", 2, False)
    assert uvicorn_config(object(), ServerConfig()).access_log is True


async def test_cors_credentials_methods_and_headers_are_the_configured_ones(make_app):
    app = make_app(
        allowed_origins=["https://ui.example"],
        allowed_methods=["POST"],
        allowed_headers=["x-custom"],
        allow_credentials=True,
    )
    async with client_for(app) as http_client:
        preflight = await http_client.options(
            "/v1/completions",
            headers={
                "Origin": "https://ui.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "x-custom",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-credentials"] == "true"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "GET" not in preflight.headers["access-control-allow-methods"]
        assert "x-custom" in preflight.headers["access-control-allow-headers"].lower()
        refused = await http_client.options(
            "/v1/completions",
            headers={"Origin": "https://ui.example", "Access-Control-Request-Method": "DELETE"},
        )
        assert refused.status_code == 400  # a method the server does not allow
    async with client_for(make_app(allowed_origins=["https://ui.example"])) as http_client:
        plain = await http_client.get("/health", headers={"Origin": "https://ui.example"})
        assert "access-control-allow-credentials" not in plain.headers


async def test_chat_template_content_format_decides_what_the_template_sees(make_app, engine, tokenizer, tmp_path):
    template_file = tmp_path / "parts.jinja"
    # a template that prints the content's Python type name: string or list of parts
    template_file.write_text("{% for m in messages %}[{{ m['content'] is string }}]{% endfor %}")
    for content_format, expected in (("string", "[True]"), ("openai", "[False]")):
        app = make_app(chat_template=str(template_file), chat_template_content_format=content_format)
        async with client_for(app) as http_client:
            response = await http_client.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
            )
        assert response.status_code == 200, response.text
        assert tokenizer.decode(engine.requests[-1].prompt) == expected


async def test_server_load_counts_tracked_requests_while_they_run():
    load = ServerLoad()
    seen: list[int] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(load.in_flight)
        if scope.get("fail"):
            raise RuntimeError("boom")

    middleware = ServerLoadMiddleware(app, load)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/health", "/load"):
        await middleware({"type": "http", "path": path}, None, None)
    assert seen == [1, 1, 1, 0, 0] and load.in_flight == 0
    with pytest.raises(RuntimeError):
        await middleware({"type": "http", "path": "/v1/completions", "fail": True}, None, None)
    assert load.in_flight == 0  # a failed request is uncounted


async def test_load_route_reports_zero_without_tracking_and_needs_no_key(make_app):
    async with client_for(make_app(api_key=["k"])) as http_client:
        response = await http_client.get("/load")
        assert response.status_code == 200 and response.json() == {"server_load": 0}


async def test_requests_are_not_logged_by_default_and_logged_with_enable_log_requests(make_app, caplog):
    caplog.set_level(logging.INFO, logger="tokenloom")
    async with client_for(make_app()) as http_client:
        await http_client.post("/v1/completions", json={"prompt": "secret words", "max_tokens": 1})
    assert "secret words" not in caplog.text
    async with client_for(make_app(enable_log_requests=True)) as http_client:
        await http_client.post("/v1/completions", json={"prompt": "secret words", "max_tokens": 1})
    assert "secret words" in caplog.text


# -- the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", block_size=4)


def runner_of(llm: LLM):
    return llm.engine.executor.worker.runner


def test_kv_cache_dtype_names_the_cache_dtype(tiny_llm):
    import torch

    runner = runner_of(tiny_llm)
    assert runner.kv_cache_dtype() == torch.float32  # auto: the model's
    config = runner.config
    try:
        runner.config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, cache_dtype="bfloat16"))
        assert runner.kv_cache_dtype() == torch.bfloat16
    finally:
        runner.config = config


def test_gpu_memory_utilization_scales_the_kv_cache(tiny_llm, monkeypatch):
    from tokenloom.core.model_runner_kv_cache import KV_SAFETY_MARGIN_BYTES

    runner = runner_of(tiny_llm)
    monkeypatch.setattr(runner.platform, "available_memory_bytes", lambda: 4 * KV_SAFETY_MARGIN_BYTES)
    monkeypatch.setattr(runner.platform, "default_kv_cache_bytes", lambda: None)
    config = runner.config
    blocks = {}
    try:
        for utilization in (0.5, 1.0):
            cache = dataclasses.replace(config.cache, gpu_memory_utilization=utilization)
            scheduler = dataclasses.replace(config.scheduler, max_num_seqs=100_000)  # no "useful" cap
            runner.config = dataclasses.replace(config, cache=cache, scheduler=scheduler)
            blocks[utilization] = runner.determine_num_blocks()
    finally:
        runner.config = config
    # budget = utilization * available - margin: 1 margin at 0.5, 3 margins at 1.0
    assert 2.9 < blocks[1.0] / blocks[0.5] < 3.1


def test_prefix_caching_hash_algo_reaches_the_block_manager(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", block_size=4, prefix_caching_hash_algo="builtin")
    assert llm.engine.scheduler.block_manager.hash_algo == "builtin"


def test_distributed_executor_backend_names_the_executor(tiny_llama_dir):
    assert type(LLM(model=tiny_llama_dir, distributed_executor_backend="uni").engine.executor).__name__ == (
        "UniProcExecutor"
    )
    with pytest.raises(UnknownNameError, match="'rayy'.*mp, ray, uni"):
        LLM(model=tiny_llama_dir, distributed_executor_backend="rayy")


def test_quantization_named_must_be_registered(tiny_llama_dir):
    with pytest.raises(UnknownNameError, match="quantization.*'awq-typo'"):
        LLM(model=tiny_llama_dir, quantization="awq-typo")


def test_disable_sliding_window_gives_every_layer_full_attention():
    from transformers import MistralConfig

    from tokenloom.core.config import ModelConfig
    from tokenloom.model_api import sliding_windows_of

    config = MistralConfig(num_hidden_layers=3, sliding_window=5)
    assert sliding_windows_of(config) == [5, 5, 5]
    assert sliding_windows_of(config, ModelConfig(disable_sliding_window=True)) == [None, None, None]


def test_tokenizer_mode_slow_asks_for_the_slow_tokenizer_and_mistral_is_refused(tmp_path, monkeypatch):
    import transformers

    from tokenloom.builtin_plugins.loaders.hf_files import load_hf_tokenizer
    from tokenloom.core.config import ModelConfig

    asked: list[bool] = []
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda directory, use_fast, **kwargs: asked.append(use_fast)
    )
    for mode in ("auto", "slow"):
        load_hf_tokenizer(str(tmp_path), ModelConfig(tokenizer_mode=mode))
    assert asked == [True, False]
    for mode in ("mistral", "custom"):
        with pytest.raises(ConfigError, match=f"--tokenizer-mode: '{mode}' is not implemented"):
            EngineArgs(tokenizer_mode=mode).create_engine_config()


def test_tokenizer_mode_slow_on_a_gguf_vocabulary_is_refused_not_ignored(smollm2_gguf):
    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat
    from tokenloom.core.config import ModelConfig

    with pytest.raises(ConfigError, match="--tokenizer-mode slow: a GGUF file's vocabulary builds a fast tokenizer"):
        GGUFLoadFormat().load_tokenizer(smollm2_gguf, ModelConfig(tokenizer_mode="slow"))


def test_tensor_and_pipeline_parallel_sizes_choose_the_mp_executor():
    from tokenloom.core.engine.engine_setup import choose_executor

    config = EngineArgs(tensor_parallel_size=3, pipeline_parallel_size=2).create_engine_config()
    assert (config.parallel.world_size, choose_executor(config.parallel)) == (6, "mp")
    assert choose_executor(EngineArgs().create_engine_config().parallel) == "uni"
    ray = EngineArgs(tensor_parallel_size=2, distributed_executor_backend="ray").create_engine_config()
    assert choose_executor(ray.parallel) == "ray"
    with pytest.raises(ConfigError, match="^--tensor-parallel-size: must be a whole number of at least 1, got 0"):
        EngineArgs(tensor_parallel_size=0).create_engine_config()
    with pytest.raises(ConfigError, match="^--pipeline-parallel-size: must be a whole number of at least 1, got -2"):
        EngineArgs(pipeline_parallel_size=-2).create_engine_config()
    with pytest.raises(ConfigError, match="^--distributed-executor-backend uni runs one worker .* needs 2 workers"):
        EngineArgs(tensor_parallel_size=2, distributed_executor_backend="uni").create_engine_config()


def test_generation_config_defaults_from_a_folder_with_the_override_on_top(tiny_llama_dir, tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.3, "top_k": 7, "max_new_tokens": 5, "do_sample": True})
    )
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        generation_config=str(tmp_path),
        override_generation_config={"temperature": 0.9, "min_p": 0.1},
    )
    assert llm.engine.model_info.generation_defaults == {"temperature": 0.9, "top_k": 7, "max_tokens": 5, "min_p": 0.1}
    # offline too, as vLLM's LLM: generate() without sampling params takes them
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens, defaults.min_p) == (0.9, 7, 5, 0.1)
    [output] = llm.generate({"prompt_token_ids": [1, 2, 3]})
    assert len(output.outputs[0].token_ids) <= 5
    assert (
        LLM(model=tiny_llama_dir, dtype="float32", generation_config="vllm").engine.model_info.generation_defaults == {}
    )


def test_generation_config_choices_and_override_keys_are_checked_before_loading():
    with pytest.raises(ConfigError, match="--generation-config: '/no/such/folder' is neither auto, vllm"):
        EngineArgs(generation_config="/no/such/folder").create_engine_config()
    with pytest.raises(ConfigError, match="'do_sample' is not a request default tokenloom applies"):
        EngineArgs(override_generation_config={"do_sample": True}).create_engine_config()
    with pytest.raises(ConfigError, match="temperature must be a number"):
        EngineArgs(override_generation_config={"temperature": "hot"}).create_engine_config()


def test_guided_decoding_server_options_shape_every_json_constraint():
    from tokenloom.core.config import StructuredOutputConfig
    from tokenloom.core.structured_output import StructuredOutputManager
    from tokenloom.core.structured_output_constraints import parse_constraint
    from tokenloom.plugins.registry import Registry

    def options(**config):
        registry = Registry("structured_output_backend", "--guided-decoding-backend")
        return StructuredOutputManager(StructuredOutputConfig(**config), registry, None, 10, [0], None).options

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    default = parse_constraint({"json": schema}, options())[0]
    assert default.any_whitespace and "additionalProperties" not in default.spec
    strict = parse_constraint(
        {"json": schema}, options(disable_any_whitespace=True, disable_additional_properties=True)
    )[0]
    assert not strict.any_whitespace and strict.spec["additionalProperties"] is False


def test_kv_cache_memory_bytes_sets_the_budget(tiny_llm):
    runner = runner_of(tiny_llm)
    config = runner.config
    blocks = {}
    try:
        for budget in (1 << 20, 2 << 20):
            cache = dataclasses.replace(config.cache, kv_cache_memory_bytes=budget)
            scheduler = dataclasses.replace(config.scheduler, max_num_seqs=100_000)  # no "useful" cap
            runner.config = dataclasses.replace(config, cache=cache, scheduler=scheduler)
            blocks[budget] = runner.determine_num_blocks()
    finally:
        runner.config = config
    assert blocks[2 << 20] in (2 * blocks[1 << 20], 2 * blocks[1 << 20] + 1)


async def test_without_a_tokenizer_embeddings_take_token_ids_and_refuse_text():
    from tests.api.test_serving_pooling import FakePoolingEngine, app_for

    engine = FakePoolingEngine(None)
    engine.vocab_size = 1000  # what AsyncLLM reports when --skip-tokenizer-init leaves no tokenizer
    async with client_for(app_for(engine)) as http_client:
        ids = await http_client.post("/v1/embeddings", json={"input": [5, 6, 7]})
        assert ids.status_code == 200, ids.text
        text = await http_client.post("/v1/embeddings", json={"input": "hello"})
        assert text.status_code == 400
        assert "--skip-tokenizer-init" in text.json()["error"]["message"]
