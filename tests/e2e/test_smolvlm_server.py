"""SmolVLM (Idefics3) over HTTP (issue 35): `tokenloom serve --enable-mm-embeds` on a tiny random
checkpoint; a synthetic PNG large enough to be split into tiles, sent as a ``data:`` URL with
the official openai client, gives transformers' tokens on the same expanded prompt (vLLM's
top-5 rule); an ``image_embeds`` part (vLLM's format: base64 of a ``torch.save``'d tensor)
gives the same tokens as its image; a wrongly shaped one is a 400 naming the part."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
import torch
from helpers.idefics3_checkpoint import IMAGE_SEQ_LEN, write_tiny_idefics3
from helpers.llava_checkpoint import data_url, drawn_image
from helpers.model_parity import assert_greedy_agrees

from tests.e2e.conftest import start_server, stop_server

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 6
QUESTION = "Which colour is the square?"
NO_SPLIT = {"do_image_splitting": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_gguf):
    directory = tmp_path_factory.mktemp("tiny-smolvlm")
    return str(directory), write_tiny_idefics3(directory, smollm2_gguf)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("server") / "serve.log")
    arguments = [checkpoint[0], "--served-model-name", "tiny-smolvlm", "--dtype", "float32", "--max-model-len", "256"]
    running = start_server(
        [*arguments, "--num-gpu-blocks-override", "96", "--enable-mm-embeds", "--return-tokens-as-token-ids"],
        log_path,
    )
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def image_part(image) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


def embeds_part(tensor: torch.Tensor) -> dict:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return {"type": "image_embeds", "image_embeds": base64.b64encode(buffer.getvalue()).decode()}


def ask(client, parts: list[dict], **options):
    return client.chat.completions.create(
        model="tiny-smolvlm",
        messages=[{"role": "user", "content": parts}],
        max_tokens=NUM_NEW_TOKENS,
        temperature=0.0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"ignore_eos": True, **options},
    )


def tokens_and_top5(response) -> tuple[list[int], list[set[int]]]:
    content = response.choices[0].logprobs.content

    def token_id(token: str) -> int:
        return int(token.removeprefix("token_id:"))  # --return-tokens-as-token-ids

    return [token_id(entry.token) for entry in content], [
        {token_id(top.token) for top in entry.top_logprobs} for entry in content
    ]


def test_a_split_image_as_a_data_url_gives_transformers_tokens(client, checkpoint):
    from transformers import AutoProcessor

    image = drawn_image("red", (60, 40))
    response = ask(client, [image_part(image), {"type": "text", "text": QUESTION}])
    processor = AutoProcessor.from_pretrained(checkpoint[0])
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompt = processor.apply_chat_template(conversation, add_generation_prompt=True)
    inputs = processor(images=[image], text=prompt, return_tensors="pt")
    assert inputs["pixel_values"].shape[1] == 5  # 2 x 2 tiles and the global image
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
    assert_greedy_agrees([tokens_and_top5(response)], [theirs])


def test_image_embeds_give_the_same_tokens_as_their_image(client, checkpoint):
    from transformers import AutoProcessor

    image = drawn_image("blue", (60, 40))
    processor = AutoProcessor.from_pretrained(checkpoint[0])
    pixel_values = processor.image_processor(images=[[image]], return_tensors="pt", **NO_SPLIT)["pixel_values"]
    with torch.no_grad():
        features = checkpoint[1].model.get_image_features(pixel_values).pooler_output[0]
    assert features.shape[0] == IMAGE_SEQ_LEN
    by_image = ask(client, [image_part(image), {"type": "text", "text": QUESTION}], mm_processor_kwargs=NO_SPLIT)
    by_embeds = ask(client, [embeds_part(features), {"type": "text", "text": QUESTION}])
    assert by_embeds.usage.prompt_tokens == by_image.usage.prompt_tokens
    assert tokens_and_top5(by_embeds)[0] == tokens_and_top5(by_image)[0]
    first_logprob = [response.choices[0].logprobs.content[0].logprob for response in (by_image, by_embeds)]
    assert first_logprob[1] == pytest.approx(first_logprob[0], abs=1e-4)


def test_wrongly_shaped_image_embeds_are_a_400_naming_the_part(server, client):
    with pytest.raises(openai.BadRequestError) as raised:
        ask(client, [{"type": "text", "text": QUESTION}, embeds_part(torch.zeros(IMAGE_SEQ_LEN + 1, 64))])
    error = raised.value.body
    assert error["param"] == "messages[0].content[1]", error
    assert f"image_embeds of shape ({IMAGE_SEQ_LEN + 1}, 64)" in error["message"], error
    assert httpx.get(server.base_url + "/health").status_code == 200
