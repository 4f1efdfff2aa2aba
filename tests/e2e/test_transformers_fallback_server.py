"""`tokenloom serve` of an architecture with no native plugin (a tiny random GPT-NeoX with
SmolLM2's tokenizer): the Transformers fallback is chosen and says so at start-up, and the
server answers the openai client's completions (greedy ids agreeing with transformers'
``generate``) and chat completions. One server for the module, short generations."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers
from helpers.model_parity import hf_greedy_top_k, randomize_parameters

from tests.e2e.conftest import start_server, stop_server

PROMPTS = [[504, 3575, 282, 4649, 314], [1, 29, 6425, 42]]
NUM_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def neox(tmp_path_factory, tiny_llama_dir):
    directory = tmp_path_factory.mktemp("gpt-neox")
    for path in Path(tiny_llama_dir).iterdir():  # the tokenizer and its chat template, not the Llama
        if path.name not in ("config.json", "generation_config.json", "model.safetensors"):
            shutil.copy(path, directory / path.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    config = transformers.GPTNeoXConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        rotary_pct=0.5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        architectures=["GPTNeoXForCausalLM"],
    )
    torch.manual_seed(2)
    hf_model = randomize_parameters(transformers.GPTNeoXForCausalLM(config).eval(), seed=2)
    with torch.no_grad():  # biases around 0, not 1: greedy decoding would repeat one token
        for name, param in hf_model.named_parameters():
            if name.endswith("bias"):
                param.sub_(1.0)
    hf_model.save_pretrained(str(directory))
    return str(directory), hf_model


@pytest.fixture(scope="module")
def server(neox, tmp_path_factory):
    directory, _ = neox
    running = start_server(
        [directory, "--served-model-name", "neox", "--dtype", "float32", "--max-model-len", "128"],
        str(tmp_path_factory.mktemp("serve") / "serve.log"),
    )
    yield running
    stop_server(running)


def test_the_start_up_log_names_the_fallback_and_the_transformers_class(server):
    log = server.log()
    assert (
        "model implementation (--model-impl auto): the Transformers fallback, running transformers' GPTNeoXForCausalLM"
        in log
    )


def test_greedy_completions_agree_with_transformers(server, neox):
    from openai import OpenAI

    _, hf_model = neox
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    completion = client.completions.create(
        model="neox",
        prompt=PROMPTS,
        max_tokens=NUM_NEW_TOKENS,
        temperature=0,
        logprobs=5,
        extra_body={"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True},
    )
    for choice in sorted(completion.choices, key=lambda choice: choice.index):
        expected_tokens, expected_top = hf_greedy_top_k(hf_model, PROMPTS[choice.index], NUM_NEW_TOKENS)
        assert len(set(expected_tokens)) > 2, "greedy decoding is degenerate"
        tokens = choice.token_ids
        top = [{int(key.removeprefix("token_id:")) for key in step} for step in choice.logprobs.top_logprobs]
        assert len(tokens) == NUM_NEW_TOKENS
        for position, (ours, theirs) in enumerate(zip(tokens, expected_tokens)):
            if ours != theirs:
                assert ours in expected_top[position] and theirs in top[position], (
                    f"prompt {choice.index} diverges at step {position}: ours {tokens}, transformers {expected_tokens}"
                )
                break


def test_a_chat_completion_is_answered(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="neox",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 4
    assert isinstance(reply.choices[0].message.content, str)
