"""The real `tokenloom serve` on a compressed-tensors checkpoint (FP8 weights with dynamic per-token
activations, as llm-compressor's FP8_DYNAMIC writes it, made by tests/helpers/compressed_tensors_files.py
from a tiny random Llama) answering the official openai client: the quantization detected from
config.json, the greedy chat completion transformers gives on the same weights dequantized."""

from __future__ import annotations

import openai
import pytest
import torch
from helpers.compressed_tensors_files import write_compressed, write_random_llama

from tests.e2e.conftest import start_server, stop_server

MESSAGES = [{"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_gguf):
    dense = write_random_llama(tmp_path_factory.mktemp("dense-llama"), smollm2_gguf)
    return write_compressed(dense, tmp_path_factory.mktemp("fp8"), scheme="FP8_DYNAMIC")


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoints):
    log_path = str(tmp_path_factory.mktemp("compressed-tensors-server") / "serve.log")
    running = start_server(
        [checkpoints[0], "--served-model-name", "tiny-fp8", "--dtype", "float32", "--max-model-len", "128"], log_path
    )
    yield running
    stop_server(running)


def test_a_chat_completion_is_the_greedy_answer_of_the_dequantized_weights(server, checkpoints):
    from transformers import AutoTokenizer, LlamaForCausalLM

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    assert "compressed-tensors" in server.log()  # detected from config.json: no --quantization flag
    response = client.chat.completions.create(model="tiny-fp8", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "length" and response.usage.completion_tokens == MAX_TOKENS

    tokenizer = AutoTokenizer.from_pretrained(checkpoints[1])
    model = LlamaForCausalLM.from_pretrained(checkpoints[1], dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False)
    expected = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert choice.message.content == expected
