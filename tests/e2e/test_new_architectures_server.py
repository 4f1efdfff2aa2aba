"""Gemma 2, OLMo 2, Granite and Phi-3 over HTTP: `tokenloom serve` on a tiny random GGUF of each
(llama.cpp's tensor names and metadata), greedy completions of token-id prompts compared with
transformers' ``generate`` the way vLLM's model tests compare (agreeing until the first position
where each side's token is in the other's top-5). One server per architecture, in turn."""

from __future__ import annotations

import httpx
import pytest
import torch
import transformers
from helpers.gguf_files import write_model_gguf
from helpers.model_parity import hf_greedy_top_k, randomize_parameters

from tests.e2e.conftest import start_server, stop_server

PROMPTS = [[9, 14, 130, 3, 57, 71], [100, 6, 28], [45, 2, 19, 88, 110, 7, 36, 52, 9, 140]]
SHAPE = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
MODELS = {
    "gemma2": (
        transformers.Gemma2ForCausalLM,
        transformers.Gemma2Config(
            **SHAPE, head_dim=16, query_pre_attn_scalar=16, sliding_window=4, attn_logit_softcapping=6.0
        ),
    ),
    "olmo2": (transformers.Olmo2ForCausalLM, transformers.Olmo2Config(**SHAPE)),
    "granite": (
        transformers.GraniteForCausalLM,
        transformers.GraniteConfig(
            **SHAPE, embedding_multiplier=6.0, residual_multiplier=0.4, attention_multiplier=0.25, logits_scaling=3.0
        ),
    ),
    "phi3": (transformers.Phi3ForCausalLM, transformers.Phi3Config(**SHAPE)),
}
NUM_NEW_TOKENS = 8


@pytest.fixture(scope="module", params=sorted(MODELS))
def served(request, tmp_path_factory):
    architecture = request.param
    model_class, config = MODELS[architecture]
    torch.manual_seed(1)
    hf_model = randomize_parameters(model_class(config).eval(), seed=1)
    if architecture == "gemma2":
        with torch.no_grad():  # a tied head would otherwise mostly repeat the current token
            hf_model.model.embed_tokens.weight.mul_(SHAPE["hidden_size"] ** -0.5)
    directory = tmp_path_factory.mktemp(architecture)
    path = write_model_gguf(str(directory / "model.gguf"), architecture, hf_model.config, hf_model.state_dict())
    server = start_server(
        [path, "--dtype", "float32", "--max-model-len", "64", "--skip-tokenizer-init"], str(directory / "serve.log")
    )
    yield architecture, hf_model, server
    stop_server(server)


def test_greedy_completions_agree_with_transformers(served):
    architecture, hf_model, server = served
    for prompt in PROMPTS:
        expected_tokens, expected_top = hf_greedy_top_k(hf_model, prompt, NUM_NEW_TOKENS)
        assert len(set(expected_tokens)) > 2, "greedy decoding is degenerate"
        body = {
            "model": server_model_name(server),
            "prompt": prompt,
            "max_tokens": NUM_NEW_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": 5,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        tokens = choice["token_ids"]
        top = [{int(key.removeprefix("token_id:")) for key in step} for step in choice["logprobs"]["top_logprobs"]]
        assert len(tokens) == NUM_NEW_TOKENS
        for position, (ours, theirs) in enumerate(zip(tokens, expected_tokens)):
            if ours != theirs:
                assert ours in expected_top[position] and theirs in top[position], (
                    f"{architecture}: diverges at step {position}: ours {tokens}, transformers {expected_tokens}"
                )
                break


def server_model_name(server) -> str:
    return httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
