"""Qwen2.5-VL offline, on a tiny random checkpoint (its window attention and M-RoPE): greedy
tokens against transformers' ``generate`` for two images of different sizes in one prompt and
for an image followed by a long text (decode positions past the image's delta), every prompt
prefilled in chunks that end inside an image; the processor's dynamic resolution (placeholder
counts against the image processor, ``min_pixels``/``max_pixels`` options). Qwen2-VL over HTTP
is tests/e2e/test_qwen2_vl_server.py."""

from __future__ import annotations

import pytest
from helpers.llava_checkpoint import drawn_image
from helpers.model_parity import assert_greedy_agrees
from helpers.qwen2_vl_checkpoint import hf_greedy, hf_inputs, write_tiny_qwen2_vl

from tokenloom import LLM, SamplingParams
from tokenloom.builtin_plugins.models.qwen2_vl_processing import Qwen2VLProcessor
from tokenloom.core.multimodal.processor import ProcessorContext
from tokenloom.errors import InvalidRequestError

NUM_NEW_TOKENS = 8
CHUNK = 16  # prefill chunks of 16 tokens: the first image of each prompt spans a boundary
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
ENGINE = dict(
    dtype="float32", max_model_len=512, num_gpu_blocks_override=128, block_size=4, max_num_batched_tokens=CHUNK
)


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_gguf):
    directory = tmp_path_factory.mktemp("tiny-qwen2.5-vl")
    hf_model = write_tiny_qwen2_vl(directory, smollm2_gguf, qwen2_5=True)
    return str(directory), hf_model


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(model=checkpoint[0], **ENGINE)


@pytest.fixture(scope="module")
def processor(checkpoint, llm):
    from transformers import AutoConfig

    return Qwen2VLProcessor(
        ProcessorContext(AutoConfig.from_pretrained(checkpoint[0]), checkpoint[0], llm.get_tokenizer(), {})
    )


def test_greedy_tokens_agree_with_transformers_prefilled_in_chunks_inside_images(llm, processor, checkpoint):
    directory, hf_model = checkpoint
    tokenizer = llm.get_tokenizer()
    long_text = " ".join(["Describe the square, its colour, its size and where it sits in the picture."] * 6)
    cases = [
        (
            chat(f"{IMAGE}Compare it with {IMAGE}Which colours are the squares?"),
            [drawn_image("red", (200, 80)), drawn_image("blue", (60, 150))],
        ),
        (chat(f"Look: {IMAGE}{long_text}"), [drawn_image("green", (100, 100))]),
    ]
    ours, theirs, lengths = [], [], []
    for text, images in cases:
        processed = processor.process(tokenizer.encode(text, add_special_tokens=False), images, {})
        inputs = hf_inputs(directory, tokenizer, text, images)
        assert processed.prompt_token_ids == inputs["input_ids"][0].tolist()  # the same placeholder counts
        lengths.append([item.length for item in processed.items])
        first = processed.items[0]
        assert first.offset < CHUNK * (first.offset // CHUNK + 1) < first.end  # a chunk ends inside it
        output = llm.generate(
            [{"prompt_token_ids": processed.prompt_token_ids, "mm_items": processed.items}],
            SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5),
        )[0].outputs[0]
        ours.append((list(output.token_ids), [set(step) for step in output.logprobs]))
        theirs.append(hf_greedy(hf_model, inputs, NUM_NEW_TOKENS))
    # 80 x 200 -> 84 x 196: 6 x 14 patches; 150 x 60 -> 140 x 56: 10 x 4; 100 x 100 -> 112 x 112: 8 x 8
    assert lengths == [[21, 10], [16]]
    assert_greedy_agrees(ours, theirs)


def test_min_and_max_pixels_bound_the_placeholder_count(processor, llm):
    from transformers import AutoImageProcessor

    image_processor = AutoImageProcessor.from_pretrained(processor.ctx.model_path)
    prompt = llm.get_tokenizer().encode(chat(IMAGE), add_special_tokens=False)
    image = drawn_image("red", (300, 200))
    for options, expected_tokens in [
        ({}, 54),  # 200 x 300 -> 168 x 252 (under 64 tokens' pixels): 12 x 18 patches
        ({"max_pixels": 28 * 28 * 12}, 8),  # -> 56 x 112
        ({"min_pixels": 28 * 28 * 100, "max_pixels": 28 * 28 * 200}, 117),  # -> 252 x 364
    ]:
        item = processor.process(prompt, [image], options).items[0]
        size = {
            "shortest_edge": options.get("min_pixels", 56 * 56),
            "longest_edge": options.get("max_pixels", 28 * 28 * 64),
        }
        grid = image_processor(images=[image], size=size, return_tensors="pt")["image_grid_thw"][0]
        assert item.length == int(grid.prod()) // 4 == expected_tokens, options
    with pytest.raises(InvalidRequestError, match="max_pixels must be a positive whole number"):
        processor.process(prompt, [image], {"max_pixels": "many"})
    with pytest.raises(InvalidRequestError, match="do not suit the image processor"):
        processor.process(prompt, [image], {"size": {"longest_edge": "many"}})
