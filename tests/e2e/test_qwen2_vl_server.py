"""Qwen2-VL over HTTP (issue 35): `tokenloom serve` on a tiny random Qwen2-VL checkpoint,
synthetic PNGs of different sizes sent as ``data:`` URLs with the official openai client, prefill
in chunks that end inside an image; greedy tokens against transformers' ``generate`` on the same
inputs (vLLM's top-5 rule) for two images in one prompt and for an image followed by a long
text (the decode positions after M-RoPE's delta); ``max_pixels`` per request changing the
image's placeholder count as the image processor says."""

from __future__ import annotations

import openai
import pytest
from helpers.llava_checkpoint import data_url, drawn_image
from helpers.model_parity import assert_greedy_agrees
from helpers.qwen2_vl_checkpoint import hf_greedy, hf_inputs, write_tiny_qwen2_vl

from tests.e2e.conftest import start_server, stop_server

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 8
QUESTION = "Which colours are the squares?"
LONG_TEXT = " ".join(["Describe the square, its colour, its size and where it sits in the picture."] * 6)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_gguf):
    directory = tmp_path_factory.mktemp("tiny-qwen2-vl")
    return str(directory), write_tiny_qwen2_vl(directory, smollm2_gguf)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("server") / "serve.log")
    running = start_server(
        [
            checkpoint[0],
            "--served-model-name",
            "tiny-qwen2-vl",
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--num-gpu-blocks-override",
            "128",
            "--max-num-batched-tokens",
            "16",  # every image below spans a prefill chunk boundary
            "--limit-mm-per-prompt",
            '{"image": 2}',
            "--return-tokens-as-token-ids",
        ],
        log_path,
    )
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def image_part(image) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


def ask(client, parts: list[dict], **options):
    return client.chat.completions.create(
        model="tiny-qwen2-vl",
        messages=[{"role": "user", "content": parts}],
        max_tokens=NUM_NEW_TOKENS,
        temperature=0.0,
        **options,
    )


def token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))  # --return-tokens-as-token-ids


def template_parts(parts: list[dict]) -> list[dict]:
    return [{"type": "image"} if part["type"] == "image_url" else part for part in parts]


@pytest.mark.parametrize(
    "case",
    [
        pytest.param([("red", (200, 80)), QUESTION, ("blue", (60, 150))], id="two-images-of-different-sizes"),
        pytest.param([("green", (100, 100)), LONG_TEXT], id="an-image-then-long-text"),
    ],
)
def test_greedy_tokens_agree_with_transformers(client, checkpoint, case):
    from transformers import AutoTokenizer

    directory, hf_model = checkpoint
    images = [drawn_image(*entry) for entry in case if isinstance(entry, tuple)]
    image_iter = iter(images)
    parts = [
        image_part(next(image_iter)) if isinstance(entry, tuple) else {"type": "text", "text": entry} for entry in case
    ]
    response = ask(client, parts, logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
    content = response.choices[0].logprobs.content
    ours = (
        [token_id(entry.token) for entry in content],
        [{token_id(top.token) for top in entry.top_logprobs} for entry in content],
    )
    tokenizer = AutoTokenizer.from_pretrained(directory)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": template_parts(parts)}], add_generation_prompt=True, tokenize=False
    )
    inputs = hf_inputs(directory, tokenizer, prompt, images)
    assert response.usage.prompt_tokens == inputs["input_ids"].shape[1]  # the same expanded prompt
    assert_greedy_agrees([ours], [hf_greedy(hf_model, inputs, NUM_NEW_TOKENS)])


def test_request_max_pixels_sets_the_image_token_count(client):
    image = drawn_image("purple", (300, 200))
    parts = [image_part(image), {"type": "text", "text": QUESTION}]
    default = ask(client, parts).usage.prompt_tokens
    smaller = ask(client, parts, extra_body={"mm_processor_kwargs": {"max_pixels": 28 * 28 * 12}}).usage.prompt_tokens
    # 200 x 300 is 12 x 18 patches (54 tokens) under the checkpoint's max_pixels, 4 x 8 (8 tokens) under 9408
    assert default - smaller == 54 - 8
    with pytest.raises(openai.BadRequestError) as raised:
        ask(client, parts, extra_body={"mm_processor_kwargs": {"max_pixels": -1}})
    assert raised.value.body["param"] == "mm_processor_kwargs"
    assert "max_pixels must be a positive whole number" in raised.value.body["message"]
