"""Images in, text out over HTTP (issue 35): `tokenloom serve` on a tiny random LLaVA-1.5
checkpoint, synthetic PNGs sent as ``data:`` URLs (and a ``file://`` one) with the official
openai client; greedy tokens against transformers' ``generate`` on the same images (vLLM's
top-5 rule); every refusal a 400 naming the content part, with the server still serving; the
encoder metrics counting one run for an image sent twice."""

from __future__ import annotations

import base64
import re

import httpx
import openai
import pytest
import torch
from helpers.llava_checkpoint import data_url, drawn_image, png_bytes, write_tiny_llava
from helpers.model_parity import assert_greedy_agrees

from tests.e2e.conftest import start_server, stop_server

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 6
QUESTION = "Which colours are the squares?"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_gguf):
    directory = tmp_path_factory.mktemp("tiny-llava")
    return str(directory), write_tiny_llava(directory, smollm2_gguf)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("media")
    (directory / "square.png").write_bytes(png_bytes(drawn_image("orange")))
    return directory


@pytest.fixture(scope="module")
def server(checkpoint, media_dir, tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("server") / "serve.log")
    running = start_server(
        [
            checkpoint[0],
            "--served-model-name",
            "tiny-llava",
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--num-gpu-blocks-override",
            "64",
            "--limit-mm-per-prompt",
            '{"image": 2}',
            "--allowed-local-media-path",
            str(media_dir),
            "--allowed-media-domains",
            "images.example.org",
            "--return-tokens-as-token-ids",
        ],
        log_path,
    )
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def ask(client, parts: list[dict], **options):
    return client.chat.completions.create(
        model="tiny-llava",
        messages=[{"role": "user", "content": parts}],
        max_tokens=NUM_NEW_TOKENS,
        temperature=0.0,
        **options,
    )


def token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))  # --return-tokens-as-token-ids


def test_two_images_as_data_urls_give_transformers_tokens(client, checkpoint):
    from transformers import AutoProcessor

    images = [drawn_image("red"), drawn_image("blue", (30, 60))]
    response = ask(
        client,
        [image_part(data_url(images[0])), image_part(data_url(images[1])), {"type": "text", "text": QUESTION}],
        logprobs=True,
        top_logprobs=5,
        extra_body={"ignore_eos": True},
    )
    content = response.choices[0].logprobs.content
    ours = (
        [token_id(entry.token) for entry in content],
        [{token_id(top.token) for top in entry.top_logprobs} for entry in content],
    )
    processor = AutoProcessor.from_pretrained(checkpoint[0])
    conversation = [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": QUESTION}]}
    ]
    prompt = processor.apply_chat_template(conversation, add_generation_prompt=True)
    inputs = processor(images=images, text=prompt, return_tensors="pt")
    assert response.usage.prompt_tokens == inputs["input_ids"].shape[1]  # the same expanded prompt
    with torch.no_grad():
        generated = checkpoint[1].generate(
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


def test_a_file_url_under_the_allowed_path_is_read(client, media_dir):
    by_file = ask(client, [image_part(f"file://{media_dir}/square.png"), {"type": "text", "text": QUESTION}])
    by_data = ask(client, [image_part(data_url(drawn_image("orange"))), {"type": "text", "text": QUESTION}])
    assert by_file.choices[0].message.content == by_data.choices[0].message.content


def test_request_mm_processor_kwargs_reach_the_image_processor(client):
    parts = [image_part(data_url(drawn_image("red"))), {"type": "text", "text": QUESTION}]
    options = dict(logprobs=True, top_logprobs=1)
    plain = ask(client, parts, **options).choices[0].logprobs.content[0].logprob
    unnormalized = ask(client, parts, extra_body={"mm_processor_kwargs": {"do_normalize": False}}, **options)
    assert unnormalized.choices[0].logprobs.content[0].logprob != pytest.approx(plain, abs=1e-4)


def truncated_png() -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(drawn_image("red"))[:80]).decode()


def huge_png() -> str:
    from PIL import Image

    return data_url(Image.new("RGB", (5000, 4000), "white"))  # 20 million pixels


BAD_IMAGES = {
    "not an image": ([image_part("data:image/png;base64," + base64.b64encode(b"hello").decode())], 0, "not an image"),
    "bad base64": ([image_part("data:image/png;base64,@@@")], 0, "not valid base64"),
    "truncated": ([image_part(truncated_png())], 0, "truncated"),
    "too many pixels": ([image_part(huge_png())], 0, "pixels"),
    "over the limit": (
        [image_part(data_url(drawn_image(color))) for color in ("red", "blue", "green")],
        2,
        "at most 2",
    ),
    "file outside the path": ([image_part("file:///etc/hostname")], 0, "not under --allowed-local-media-path"),
    "domain not allowed": ([image_part("https://elsewhere.example.com/cat.png")], 0, "--allowed-media-domains"),
    "no url": ([{"type": "image_url", "image_url": {}}], 0, "needs"),
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_a_bad_image_is_a_400_naming_the_part_and_the_server_stays_up(server, client, case):
    parts, bad_index, message = BAD_IMAGES[case]
    with pytest.raises(openai.BadRequestError) as raised:
        ask(client, [{"type": "text", "text": QUESTION}, *parts])
    error = raised.value.body
    assert error["param"] == f"messages[0].content[{bad_index + 1}]", error
    assert message in error["message"], error
    assert httpx.get(server.base_url + "/health").status_code == 200


def metric(server, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics").text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert match, f"{name} is missing from /metrics"
    return float(match.group(1))


def test_an_image_sent_twice_is_encoded_once(server, client):
    image = data_url(drawn_image("magenta", (50, 50)))
    queries, hits = metric(server, "vllm:mm_cache_queries_total"), metric(server, "vllm:mm_cache_hits_total")
    ask(client, [image_part(image), {"type": "text", "text": "First look."}])
    # other words first: a prefix-cache hit would skip the image altogether
    ask(client, [{"type": "text", "text": "Second look, other words first."}, image_part(image)])
    assert metric(server, "vllm:mm_cache_queries_total") - queries == 2
    assert metric(server, "vllm:mm_cache_hits_total") - hits == 1  # encoded once


def test_responses_input_image_and_messages_image_blocks_see_the_same_image(server, client):
    image = drawn_image("teal", (36, 36))
    url = data_url(image)
    chat = ask(client, [image_part(url), {"type": "text", "text": QUESTION}]).choices[0].message.content
    responses = httpx.post(
        server.base_url + "/v1/responses",
        json={
            "model": "tiny-llava",
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": QUESTION}],
                }
            ],
            "max_output_tokens": NUM_NEW_TOKENS,
            "temperature": 0.0,
        },
        timeout=120,
    )
    assert responses.status_code == 200, responses.text
    assert responses.json()["output"][-1]["content"][0]["text"] == chat
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png_bytes(image)).decode()}
    messages = httpx.post(
        server.base_url + "/v1/messages",
        json={
            "model": "tiny-llava",
            "messages": [
                {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}]}
            ],
            "max_tokens": NUM_NEW_TOKENS,
            "temperature": 0.0,
        },
        timeout=120,
    )
    assert messages.status_code == 200, messages.text
    assert messages.json()["content"][0]["text"] == chat
