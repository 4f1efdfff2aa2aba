"""LoRA adapters over HTTP with the ``openai`` client, on the real SmolLM2 server: an adapter
given with --lora-modules is listed with its parent and answers by its name; one loaded at
runtime (VLLM_ALLOW_RUNTIME_LORA_UPDATING) answers exactly as the same files did under the
other name, then unloads into a 404; bad adapters and unknown names get OpenAI-shaped 4xx that
say what is wrong; the API key guards the runtime routes; the lora_requests_info gauge is
exported."""

from __future__ import annotations

import os

import httpx
import openai
import pytest
from helpers.gguf_reference import transformers_model
from helpers.lora_adapters import ALL_PROJECTIONS, save_random_adapter

from tests.e2e.conftest import API_KEY, start_server, stop_server

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapter_dirs(smollm2_gguf, tmp_path_factory):
    base = transformers_model(smollm2_gguf)
    root = tmp_path_factory.mktemp("server-adapters")
    return {
        "good": save_random_adapter(base, root / "good", r=8, alpha=16, targets=ALL_PROJECTIONS, seed=3, scale=0.05),
        "rank32": save_random_adapter(base, root / "rank32", r=32, alpha=32, targets=["q_proj"], seed=4, scale=0.05),
    }


@pytest.fixture(scope="module")
def server(adapter_dirs, tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("lora-server") / "serve.log")
    previous = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    try:
        running = start_server(
            [
                "smollm2",
                "--max-model-len",
                "512",
                "--api-key",
                API_KEY,
                "--enable-lora",
                "--max-loras",
                "2",
                "--max-lora-rank",
                "16",
                "--lora-modules",
                f'{{"name": "static", "path": "{adapter_dirs["good"]}", "base_model_name": "smollm2"}}',
            ],
            log_path,
        )
    finally:
        if previous is None:
            os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)
        else:
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = previous
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)


def complete(client, model):
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0.0)
    return response.choices[0].text


def post(server, path, body, key=API_KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=120)


def test_static_adapter_is_listed_with_its_parent_and_used_by_name(client):
    cards = {model.id: model for model in client.models.list().data}
    assert set(cards) == {"smollm2", "static"}
    assert cards["static"].model_extra["parent"] == "smollm2"
    assert cards["smollm2"].model_extra["parent"] is None
    base, adapted = complete(client, "smollm2"), complete(client, "static")
    assert adapted != base
    chat = client.chat.completions.create(
        model="static", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0.0
    )
    assert chat.model == "static" and chat.choices[0].message.content


def test_runtime_load_use_list_unload(server, client, adapter_dirs):
    expected = complete(client, "static")
    unauthorized = post(
        server, "/v1/load_lora_adapter", {"lora_name": "live", "lora_path": adapter_dirs["good"]}, key=None
    )
    assert unauthorized.status_code == 401
    response = post(server, "/v1/load_lora_adapter", {"lora_name": "live", "lora_path": adapter_dirs["good"]})
    assert response.status_code == 200, response.text
    assert "live" in {model.id for model in client.models.list().data}
    # the same files under another name (another id, so no shared prefix cache): the same text
    assert complete(client, "live") == expected
    again = post(server, "/v1/load_lora_adapter", {"lora_name": "live", "lora_path": adapter_dirs["good"]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "live"}).status_code == 200
    assert "live" not in {model.id for model in client.models.list().data}
    with pytest.raises(openai.NotFoundError, match="'live' does not exist"):
        complete(client, "live")
    missing = post(server, "/v1/unload_lora_adapter", {"lora_name": "live"})
    assert missing.status_code == 404 and missing.json()["error"]["message"]


def test_bad_adapters_are_refused_saying_why(server, client, adapter_dirs, tmp_path):
    too_big = post(server, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": adapter_dirs["rank32"]})
    assert too_big.status_code == 400
    assert "more than --max-lora-rank 16" in too_big.json()["error"]["message"]
    nowhere = post(server, "/v1/load_lora_adapter", {"lora_name": "nowhere", "lora_path": str(tmp_path / "nowhere")})
    assert nowhere.status_code == 400 and "is not a usable adapter" in nowhere.json()["error"]["message"]
    assert "big" not in {model.id for model in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        complete(client, "no-such-adapter")
    assert complete(client, "static")  # the server still serves


def test_lora_requests_info_gauge(server):
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in text
