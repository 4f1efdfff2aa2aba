"""LoRA adapters from tenants, over HTTP against the real SmolLM2 server (issue 37, items 3 and
11), once with tokenloom's CPU kernels and once without (TOKENLOOM_CPU_KERNELS=0: the torch
LoRA and attention paths):

- an adapter whose weights are huge but finite (3e38: its products overflow, its requests'
  activations become inf and nan) runs next to base-model requests, which keep their greedy
  text, and so do later ones;
- an adapter holding nan is refused at load, saying so;
- loading edges: a 0-dim ``lora_A`` is a 400, every unusable path gets the same message, a Hub
  repo id is not downloaded at runtime, the adapters a server serves are bounded by
  ``--max-cpu-loras``, and two concurrent loads of one name give one adapter."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from helpers.lora_adapters import save_constant_adapter
from safetensors.torch import save_file

from tests.e2e.conftest import start_server, stop_server

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "List three prime numbers:", "Count from one to ten: one, two,"]
MAX_CPU_LORAS = 3


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tenant-adapters")
    return {
        "huge": save_constant_adapter(root / "huge", value=3e38),
        "nan": save_constant_adapter(root / "nan", value=float("nan"), targets=["q_proj"], embeddings=False),
        "small": save_constant_adapter(root / "small", value=1e-3, targets=["q_proj"], embeddings=False),
    }


@pytest.fixture(scope="module", params=["native", "torch"])
def server(request, tmp_path_factory, adapter_dirs):
    kernels = {"native": "require", "torch": "0"}[request.param]
    log_path = str(tmp_path_factory.mktemp(f"lora-hardening-{request.param}") / "serve.log")
    overrides = {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true",
        "TOKENLOOM_CPU_KERNELS": kernels,
        "HF_HUB_OFFLINE": "1",  # a Hub download must not even be tried; never wait on a network
        "TOKENLOOM_ALLOW_RUNTIME_LORA_HUB": "",
    }
    previous = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        running = start_server(
            [
                "smollm2",
                "--max-model-len",
                "512",
                "--max-num-seqs",
                "16",
                "--enable-lora",
                "--max-loras",
                "2",
                "--max-lora-rank",
                "8",
                "--max-cpu-loras",
                str(MAX_CPU_LORAS),
                "--lora-modules",
                f"huge={adapter_dirs['huge']}",
            ],
            log_path,
        )
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    running.kernels = request.param
    yield running
    stop_server(running)


def complete(server, model, prompt, max_tokens=8):
    response = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0},
        timeout=300,
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def load(server, name, path):
    return httpx.post(
        server.base_url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=120
    )


def unload(server, name):
    return httpx.post(server.base_url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=120)


def served_adapters(server):
    models = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"]
    return sorted(card["id"] for card in models if card["parent"])


def test_base_requests_keep_their_text_next_to_an_overflowing_adapter(server):
    later = [prompt + " Explain." for prompt in PROMPTS]
    alone = {prompt: complete(server, "smollm2", prompt) for prompt in PROMPTS + later}
    assert all(alone[prompt] for prompt in PROMPTS), alone
    # the adapter's own requests and base-model ones, in the same batches
    jobs = [("huge", prompt) for prompt in PROMPTS] * 2 + [("smollm2", prompt) for prompt in PROMPTS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(lambda job: complete(server, *job), jobs))
    for (model, prompt), text in zip(jobs, texts):
        if model == "smollm2":
            assert text == alone[prompt], (server.kernels, prompt, text)
    # and later ones (stale KV left in freed blocks is checked exactly in tests/kernels)
    for prompt in PROMPTS + later:
        assert complete(server, "smollm2", prompt) == alone[prompt], (server.kernels, prompt)
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200


def test_a_nan_adapter_is_refused_at_load(server, adapter_dirs):
    response = load(server, "nan", adapter_dirs["nan"])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "lora_A holds nan or inf values" in error["message"] and error["param"] == "lora_path"
    assert "nan" not in served_adapters(server)


def test_loading_edges(server, adapter_dirs, tmp_path):
    if server.kernels != "native":
        pytest.skip("the loading edges do not depend on the kernels: checked on one server")
    # a 0-dim lora_A: a 400 naming the tensors, not a 500
    scalar = tmp_path / "scalar"
    scalar.mkdir()
    (scalar / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 4, "target_modules": ["q_proj"]})
    )
    save_file(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.tensor(1.0),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(576, 4),
        },
        str(scalar / "adapter_model.safetensors"),
    )
    response = load(server, "scalar", str(scalar))
    assert response.status_code == 400 and "each must be a matrix" in response.json()["error"]["message"]
    # one message for every unusable path: nothing tells a private directory from a system one
    (tmp_path / "empty").mkdir()
    messages = set()
    for path in ["/no/such/dir", "/etc", "/proc/self", str(tmp_path / "empty"), "org/adapter"]:
        response = load(server, "probe", path)
        assert response.status_code == 400, (path, response.text)
        messages.add(response.json()["error"]["message"].replace(repr(path), "PATH"))
    assert len(messages) == 1, messages
    assert "is not a usable adapter" in messages.pop()
    # --max-cpu-loras bounds the adapters served ('huge' from --lora-modules is one)
    names = [f"t{index}" for index in range(MAX_CPU_LORAS - 1)]
    for name in names:
        assert load(server, name, adapter_dirs["small"]).status_code == 200
    refused = load(server, "one-too-many", adapter_dirs["small"])
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "lora_adapter_limit"
    assert "--max-cpu-loras" in refused.json()["error"]["message"]
    for name in names:
        assert unload(server, name).status_code == 200
    # two concurrent loads of one name: one adapter, and nothing left over afterwards
    barrier = threading.Barrier(2)

    def racing_load(_):
        barrier.wait()
        return load(server, "twin", adapter_dirs["small"])

    with ThreadPoolExecutor(2) as pool:
        statuses = sorted(response.status_code for response in pool.map(racing_load, range(2)))
    assert statuses == [200, 400]
    assert served_adapters(server) == ["huge", "twin"]
    assert complete(server, "twin", PROMPTS[0])
    assert unload(server, "twin").status_code == 200
    for name in names:  # the whole bound is free again
        assert load(server, name, adapter_dirs["small"]).status_code == 200
        assert unload(server, name).status_code == 200
