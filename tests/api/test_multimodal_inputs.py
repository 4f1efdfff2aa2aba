"""The server's multimodal side (api/multimodal_inputs.py): image parts found in chat messages,
the per-prompt limits, the processor options, and a text-only model's refusal."""

from __future__ import annotations

import asyncio

import pytest

from tokenloom.api.multimodal_inputs import ImagePart, MultiModalInputs, extract_image_parts
from tokenloom.api.server_config import ServerConfig
from tokenloom.chat_template import normalize_messages
from tokenloom.core.multimodal.inputs import MultiModalItem
from tokenloom.core.multimodal.processor import ImageEmbeddings, MultiModalProcessor, ProcessedPrompt, ProcessorContext
from tokenloom.errors import ConfigError, InvalidRequestError


class RecordingProcessor(MultiModalProcessor):
    """Expands token 7 into two tokens per image and records the options it ran with."""

    placeholders = {"image": "<image>"}

    def __init__(self):
        super().__init__(ProcessorContext(None, "", None, {}))
        self.seen_kwargs: list[dict] = []

    def max_items_per_prompt(self):
        return {"image": 3}

    def process(self, prompt_token_ids, images, processor_kwargs):
        self.seen_kwargs.append(processor_kwargs)
        ids, items = [], []
        for token in prompt_token_ids:
            if token == 7:
                items.append(MultiModalItem("image", f"{len(items):064x}", len(ids), 2))
                ids += [7, 7]
            else:
                ids.append(token)
        return ProcessedPrompt(ids, items)


def test_image_parts_become_image_parts_the_template_renders():
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": "data:a"}}],
        },
        {"role": "user", "content": [{"type": "input_image", "image_url": "data:b"}]},
    ]
    rewritten, parts = extract_image_parts(messages)
    assert parts == [ImagePart("messages[1].content[1]", "data:a"), ImagePart("messages[2].content[0]", "data:b")]
    assert rewritten[0] is messages[0]
    assert rewritten[1]["content"][1] == {"type": "image"}
    assert normalize_messages(rewritten, "string", {"image": "<image>"})[1]["content"] == "Look:\n<image>"
    assert normalize_messages(rewritten, "openai", {"image": "<image>"})[2]["content"] == [{"type": "image"}]
    with pytest.raises(InvalidRequestError, match="not supported"):
        normalize_messages(rewritten, "string")  # a text-only model's renderer


def test_limits_come_from_the_flag_within_the_models_maximum():
    processor = RecordingProcessor()
    assert MultiModalInputs(processor, ServerConfig(), "m").limits == {"image": 3}
    assert MultiModalInputs(processor, ServerConfig(limit_mm_per_prompt={"image": 1}), "m").limits == {"image": 1}
    with pytest.raises(ConfigError, match="at most 3"):
        MultiModalInputs(processor, ServerConfig(limit_mm_per_prompt={"image": 4}), "m")
    with pytest.raises(ConfigError, match="names audio"):
        MultiModalInputs(processor, ServerConfig(limit_mm_per_prompt={"audio": 1}), "m")
    inputs = MultiModalInputs(processor, ServerConfig(limit_mm_per_prompt={"image": 1}), "m")
    parts = [ImagePart(f"messages[0].content[{index}]", "data:") for index in range(2)]
    with pytest.raises(InvalidRequestError, match="at most 1") as raised:
        inputs.check_parts(parts)
    assert raised.value.param == "messages[0].content[1]"


def test_a_text_only_model_refuses_the_first_image_part():
    inputs = MultiModalInputs(None, ServerConfig(), "smollm2")
    with pytest.raises(InvalidRequestError, match="smollm2 takes text only") as raised:
        inputs.check_parts([ImagePart("messages[2].content[0]", "data:")])
    assert raised.value.param == "messages[2].content[0]"


def test_request_processor_kwargs_update_the_servers():
    processor = RecordingProcessor()
    inputs = MultiModalInputs(processor, ServerConfig(mm_processor_kwargs={"a": 1, "b": 2}), "m")
    prompt = asyncio.run(inputs.prompt([1, 7, 2], ["image"], {"b": 3}))
    assert processor.seen_kwargs == [{"a": 1, "b": 3}]
    assert prompt["prompt_token_ids"] == [1, 7, 7, 2]
    assert [(item.offset, item.length) for item in prompt["mm_items"]] == [(1, 2)]


def embeds_part(tensor) -> dict:
    """vLLM's ``image_embeds`` part: base64 of the ``torch.save``'d tensor."""
    import base64
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return {"type": "image_embeds", "image_embeds": base64.b64encode(buffer.getvalue()).decode()}


class EmbedsProcessor(RecordingProcessor):
    takes_image_embeds = True


def test_image_embeds_parts_need_the_flag_and_a_model_that_takes_them():
    import torch

    tensor = torch.randn(3, 8)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, embeds_part(tensor)]}]
    rewritten, parts = extract_image_parts(messages)
    assert rewritten[0]["content"][1] == {"type": "image"}
    assert [(part.where, part.url) for part in parts] == [("messages[0].content[1]", "")]
    without_flag = MultiModalInputs(EmbedsProcessor(), ServerConfig(), "m")
    with pytest.raises(InvalidRequestError, match="start it with --enable-mm-embeds") as raised:
        without_flag.check_parts(parts)
    assert raised.value.param == "messages[0].content[1]"
    with pytest.raises(InvalidRequestError, match="m takes images, not image_embeds"):
        MultiModalInputs(RecordingProcessor(), ServerConfig(enable_mm_embeds=True), "m").check_parts(parts)
    with_flag = MultiModalInputs(EmbedsProcessor(), ServerConfig(enable_mm_embeds=True), "m")
    with_flag.check_parts(parts)
    (embeddings,) = asyncio.run(with_flag.load_images(parts))
    assert isinstance(embeddings, ImageEmbeddings) and embeddings.where == "messages[0].content[1]"
    assert torch.equal(embeddings.tensor, tensor)
    assert embeddings.hash() != ImageEmbeddings(tensor + 1, "").hash()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("@@@", "not valid base64"),
        ("aGVsbG8=", "not a torch.save'd tensor"),
        ({"t": 1}, "needs"),
        ("dict", "holds a dict, not a tensor"),
    ],
)
def test_a_bad_image_embeds_part_is_refused_naming_it(value, message):
    import torch

    part = embeds_part({"a": torch.zeros(1)}) if value == "dict" else {"type": "image_embeds", "image_embeds": value}
    inputs = MultiModalInputs(EmbedsProcessor(), ServerConfig(enable_mm_embeds=True), "m")
    with pytest.raises(InvalidRequestError, match=message) as raised:
        _, parts = extract_image_parts([{"role": "user", "content": [part]}])
        asyncio.run(inputs.load_images(parts))
    assert raised.value.param == "messages[0].content[0]"


def test_image_embeddings_are_checked_against_the_models_shape():
    import torch

    embeddings = ImageEmbeddings(torch.ones(1, 4, 8, dtype=torch.bfloat16), "messages[0].content[2]")
    checked = embeddings.checked(4, 8)
    assert checked.shape == (4, 8) and checked.dtype == torch.float32
    with pytest.raises(InvalidRequestError, match=r"content\[2\]: image_embeds of shape \(1, 4, 8\); .* \(5, 8\)"):
        embeddings.checked(5, 8)
    with pytest.raises(InvalidRequestError, match="floating-point"):
        ImageEmbeddings(torch.ones(4, 8, dtype=torch.int64), "p").checked(4, 8)
