"""Mixture-of-experts models over HTTP with the openai client: `tokenloom serve` on a tiny random
Mixtral checkpoint (safetensors, ``-tp 2``: each rank holds half of every expert's intermediate
features), tiny random Qwen3-MoE and Qwen2-MoE (a sigmoid-gated shared expert) GGUFs with Q4_0
experts (the platform's dtype: the experts run 4-bit on the moe_experts operator). A concurrent batch of mixed-length token-id prompts, each
greedy completion compared with transformers' ``generate`` the vLLM way (agreeing until the first
position where each side's token is in the other's top-5). One server per model, in turn."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from helpers.gguf_files import write_model_gguf
from helpers.model_parity import assert_greedy_agrees, hf_greedy_top_k, randomize_parameters

from tests.e2e.conftest import start_server, stop_server

PROMPTS = [
    [9, 14, 130, 3, 57, 71],
    [100, 6, 28],
    [45, 2, 19, 88, 110, 7, 36, 52, 9, 140, 11, 12, 13, 99, 98, 97, 3, 4, 5, 6],
    [77],
    [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70],
]
SHAPE = dict(
    vocab_size=160,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
NUM_NEW_TOKENS = 8


def mixtral(directory) -> tuple:
    config = transformers.MixtralConfig(**SHAPE, intermediate_size=64, num_local_experts=6, num_experts_per_tok=2)
    hf_model = randomize_parameters(transformers.MixtralForCausalLM(config).eval(), seed=2)
    hf_model.save_pretrained(str(directory))
    return hf_model, [str(directory), "-tp", "2", "--dtype", "float32"]


def qwen3_moe_q4_0(directory) -> tuple:
    config = transformers.Qwen3MoeConfig(
        **SHAPE,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        norm_topk_prob=True,  # as llama.cpp runs every qwen3moe file
    )
    hf_model = randomize_parameters(transformers.Qwen3MoeForCausalLM(config).eval(), seed=3)
    q4_0 = GGMLQuantizationType.Q4_0
    with torch.no_grad():  # transformers holds what the file holds
        for name, param in hf_model.named_parameters():
            if ".mlp.experts." in name:
                data = param.detach().numpy()
                param.copy_(torch.from_numpy(dequantize(quantize(data, q4_0), q4_0).reshape(data.shape)))
    path = write_model_gguf(
        str(directory / "model.gguf"), "qwen3moe", hf_model.config, hf_model.state_dict(), expert_quant_type=q4_0
    )
    return hf_model, [path]


def qwen2_moe_q4_0(directory) -> tuple:
    config = transformers.Qwen2MoeConfig(
        **SHAPE,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,  # as llama.cpp runs every qwen2moe file
    )
    hf_model = randomize_parameters(transformers.Qwen2MoeForCausalLM(config).eval(), seed=4)
    q4_0 = GGMLQuantizationType.Q4_0
    with torch.no_grad():  # transformers holds what the file holds
        for name, param in hf_model.named_parameters():
            if ".mlp.experts." in name:
                data = param.detach().numpy()
                param.copy_(torch.from_numpy(dequantize(quantize(data, q4_0), q4_0).reshape(data.shape)))
    path = write_model_gguf(
        str(directory / "model.gguf"), "qwen2moe", hf_model.config, hf_model.state_dict(), expert_quant_type=q4_0
    )
    return hf_model, [path]


MODELS = {"mixtral-tp2": mixtral, "qwen3moe-q4_0": qwen3_moe_q4_0, "qwen2moe-q4_0": qwen2_moe_q4_0}


@pytest.fixture(scope="module", params=sorted(MODELS))
def served(request, tmp_path_factory):
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp(request.param)
    hf_model, args = MODELS[request.param](directory)
    server = start_server([*args, "--max-model-len", "64", "--skip-tokenizer-init"], str(directory / "serve.log"))
    yield request.param, hf_model, server
    stop_server(server)


def test_a_concurrent_batch_agrees_with_transformers(served):
    name, hf_model, server = served
    expected = [hf_greedy_top_k(hf_model, prompt, NUM_NEW_TOKENS) for prompt in PROMPTS]
    assert all(len(set(tokens)) > 2 for tokens, _ in expected), "greedy decoding is degenerate"

    async def complete_all():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
            model = (await client.models.list()).data[0].id
            return await asyncio.gather(
                *(
                    client.completions.create(
                        model=model,
                        prompt=prompt,
                        max_tokens=NUM_NEW_TOKENS,
                        temperature=0.0,
                        logprobs=5,
                        extra_body={"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True},
                        timeout=120,
                    )
                    for prompt in PROMPTS
                )
            )

    ours = []
    for completion in asyncio.run(complete_all()):
        choice = completion.choices[0]
        top = [{int(key.removeprefix("token_id:")) for key in step} for step in choice.logprobs.top_logprobs]
        ours.append((list(choice.token_ids), top))
    assert_greedy_agrees(ours, expected)
    if name == "mixtral-tp2":
        assert "worker 1: model loaded in" in server.log()
