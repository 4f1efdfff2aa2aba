"""Gemma 3 with its SigLIP tower over HTTP (issue 35): `tokenloom serve` on a tiny random
checkpoint with Gemma 3's tokenizer; one and two synthetic PNGs sent as ``data:`` URLs with the
official openai client give transformers' tokens on the same expanded prompt (vLLM's top-5
rule) and its first-token log-probabilities (which need the image tokens to attend to each
other both ways); pan and scan is a 400 naming it, with the server still serving."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from helpers.gemma3_checkpoint import write_tiny_gemma3
from helpers.llava_checkpoint import data_url, drawn_image
from helpers.model_parity import assert_greedy_agrees

from tests.e2e.conftest import start_server, stop_server

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-gemma3")
    return str(directory), write_tiny_gemma3(directory)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("server") / "serve.log")
    arguments = [checkpoint[0], "--served-model-name", "tiny-gemma3", "--dtype", "float32", "--max-model-len", "256"]
    running = start_server(
        [*arguments, "--num-gpu-blocks-override", "64", "--limit-mm-per-prompt", '{"image": 2}']
        + ["--return-tokens-as-token-ids"],
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
        model="tiny-gemma3",
        messages=[{"role": "user", "content": parts}],
        max_tokens=NUM_NEW_TOKENS,
        temperature=0.0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"ignore_eos": True, **options},
    )


def token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))  # --return-tokens-as-token-ids


@pytest.mark.parametrize(
    "texts_and_images",
    [
        [None, "What is it?"],
        ["Compare", None, "and", None, "please."],
    ],
    ids=["one-image", "two-images"],
)
def test_images_as_data_urls_give_transformers_tokens(client, checkpoint, texts_and_images):
    from transformers import AutoProcessor

    colours = iter(["red", "blue"])
    images, parts, content = [], [], []
    for text in texts_and_images:
        if text is None:
            images.append(drawn_image(next(colours), (60, 40)))
            parts.append(image_part(images[-1]))
            content.append({"type": "image"})
        else:
            parts.append({"type": "text", "text": text})
            content.append({"type": "text", "text": text})
    response = ask(client, parts)
    logprobs = response.choices[0].logprobs.content
    ours = (
        [token_id(entry.token) for entry in logprobs],
        [{token_id(top.token) for top in entry.top_logprobs} for entry in logprobs],
    )
    processor = AutoProcessor.from_pretrained(checkpoint[0])
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    inputs = processor(images=images, text=prompt, return_tensors="pt", add_special_tokens=False)
    assert response.usage.prompt_tokens == inputs["input_ids"].shape[1]  # the same expanded prompt
    hf_model = checkpoint[1]
    with torch.no_grad():
        first_logprobs = hf_model(**inputs).logits[0, -1].log_softmax(-1)
        generated = hf_model.generate(
            **inputs,
            max_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    theirs = (
        generated.sequences[0, inputs["input_ids"].shape[1] :].tolist(),
        [set(scores[0].topk(5).indices.tolist()) for scores in generated.scores],
    )
    assert_greedy_agrees([ours], [theirs])
    for top in logprobs[0].top_logprobs:
        assert top.logprob == pytest.approx(first_logprobs[token_id(top.token)].item(), abs=1e-3)


def test_pan_and_scan_is_a_400_naming_it(server, client):
    with pytest.raises(openai.BadRequestError) as raised:
        ask(
            client,
            [image_part(drawn_image("red")), {"type": "text", "text": "What is it?"}],
            mm_processor_kwargs={"do_pan_and_scan": True},
        )
    error = raised.value.body
    assert error["param"] == "mm_processor_kwargs", error
    assert "do_pan_and_scan is not supported" in error["message"], error
    assert httpx.get(server.base_url + "/health").status_code == 200
