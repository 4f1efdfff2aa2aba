"""tokenloom on Ray Serve (issue 38): two models deployed on a local Ray Serve by
``tokenloom.ray_serve.build_openai_app``, queried through Serve's own HTTP proxy with the official
``openai`` client: each answers by its name, streams, refuses bad input as tokenloom does, an
unknown model is a 404 naming the served ones, and each model's health check is its engine's."""

from __future__ import annotations

from types import SimpleNamespace

import openai
import pytest

from tests.e2e.conftest import free_port
from tokenloom.errors import ConfigError
from tokenloom.ray_serve import ModelConfig, ModelServer, app_builder, build_openai_app

serve = pytest.importorskip("ray.serve", reason="Ray Serve is in the test extra; without it this module cannot run")
ray = pytest.importorskip("ray")

PROMPT = [{"role": "user", "content": "Say hello."}]
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 4}


@pytest.fixture(scope="module")
def served(smollm2_gguf):
    port = free_port()
    # a private local Ray: another module's cluster (running in parallel under xdist) leaves its
    # address in /tmp/ray, and ray.init() would join it and refuse num_cpus
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        small = {"max_model_len": 256, "max_num_seqs": 4}
        app = build_openai_app(
            [
                ModelConfig(smollm2_gguf, "smol-a", small),
                ModelConfig(
                    smollm2_gguf,
                    "smol-b",
                    {**small, "enable_prefix_caching": False},
                    deployment_config={"autoscaling_config": AUTOSCALING},
                ),
            ]
        )
        serve.run(app, name="tokenloom", route_prefix="/")
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    finally:
        serve.shutdown()
        ray.shutdown()


def test_both_models_answer_by_name_through_serves_proxy(served):
    assert sorted(model.id for model in served.models.list().data) == ["smol-a", "smol-b"]
    answers = {}
    for name in ("smol-a", "smol-b"):
        completion = served.chat.completions.create(
            model=name, messages=PROMPT, max_tokens=6, temperature=0.0, extra_body={"return_token_ids": True}
        )
        assert completion.model == name
        answers[name] = completion.choices[0].message.content
    assert answers["smol-a"] and answers["smol-a"] == answers["smol-b"]  # the same weights, greedy
    status = serve.status().applications["tokenloom"].deployments
    assert {name: str(state.status.value) for name, state in status.items()} == {
        "tokenloom:smol-a": "HEALTHY",
        "tokenloom:smol-b": "HEALTHY",
        "tokenloom-router": "HEALTHY",
    }


def test_a_stream_arrives_in_chunks_with_the_same_text(served):
    whole = served.chat.completions.create(model="smol-a", messages=PROMPT, max_tokens=6, temperature=0.0)
    stream = served.chat.completions.create(model="smol-a", messages=PROMPT, max_tokens=6, temperature=0.0, stream=True)
    pieces = [chunk.choices[0].delta.content for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == whole.choices[0].message.content


def test_bad_input_is_tokenloom_s_400_and_an_unknown_model_a_404_naming_the_served_ones(served):
    with pytest.raises(openai.BadRequestError) as bad:
        served.chat.completions.create(model="smol-b", messages=PROMPT, max_tokens=4, temperature=-1)
    assert bad.value.response.json()["error"]["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as unknown:
        served.chat.completions.create(model="smol-c", messages=PROMPT, max_tokens=4)
    assert "serves smol-a, smol-b" in unknown.value.response.json()["error"]["message"]


def test_a_replica_fails_its_health_check_once_its_engine_is_dead():
    import asyncio

    alive = SimpleNamespace(engine=SimpleNamespace(errored=False, dead_reason=None))
    asyncio.run(ModelServer.check_health(alive))  # type: ignore[arg-type]
    dead = SimpleNamespace(engine=SimpleNamespace(errored=True, dead_reason="worker 1 exited with code 1"))
    with pytest.raises(RuntimeError, match="worker 1 exited with code 1"):
        asyncio.run(ModelServer.check_health(dead))  # type: ignore[arg-type]


def test_configs_become_serve_command_lines_and_two_models_may_not_share_a_name():
    config = ModelConfig("m", "x", {"max_model_len": 64, "enable_prefix_caching": False, "hf_overrides": {"a": 1}})
    assert config.serve_argv() == [
        "m",
        "--served-model-name",
        "x",
        "--max-model-len",
        "64",
        "--enable-prefix-caching=false",
        "--hf-overrides",
        '{"a": 1}',
    ]
    with pytest.raises(ConfigError, match="two models are named 'x'"):
        build_openai_app([ModelConfig("m", "x"), ModelConfig("n", "x")])


def test_the_config_file_builder_names_what_its_args_lack():
    with pytest.raises(ConfigError, match="takes args {models: "):
        app_builder({"model": "m"})
    with pytest.raises(ConfigError, match="unexpected keyword argument 'engine_args'"):
        app_builder({"models": [{"model": "m", "engine_args": {}}]})
