"""LLaVA-NeXT offline, on a tiny random checkpoint: the prompt's tokens and tiles equal
transformers' LlavaNextProcessor's for images of several aspect ratios (the anyres grid, the
unpadding, the newline per row), greedy tokens against transformers' ``generate`` with one and
two images (vLLM's top-5 rule), the packed features against transformers' and given as
``image_embeds``, and the refusals of a processor that cannot match the model's grid."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.llava_checkpoint import drawn_image
from helpers.llava_next_checkpoint import write_tiny_llava_next
from helpers.model_parity import assert_greedy_agrees

from tokenloom import LLM, SamplingParams
from tokenloom.builtin_plugins.models.llava_next_processing import LlavaNextProcessor
from tokenloom.core.multimodal.processor import ImageEmbeddings, ProcessorContext
from tokenloom.errors import ConfigError, InvalidRequestError, ModelLoadError

NUM_NEW_TOKENS = 6
ENGINE = dict(dtype="float32", max_model_len=512, num_gpu_blocks_override=64, block_size=16)
ONE_IMAGE = "USER: <image>\nWhat is in the picture? ASSISTANT:"
TWO_IMAGES = "USER: <image>\nand <image>\nwhich differs? ASSISTANT:"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_gguf):
    directory = tmp_path_factory.mktemp("tiny-llava-next")
    hf_model = write_tiny_llava_next(directory, smollm2_gguf)
    return str(directory), hf_model


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(model=checkpoint[0], **ENGINE)


def make_processor(directory: str, tokenizer, processor_kwargs=None) -> LlavaNextProcessor:
    from transformers import AutoConfig

    return LlavaNextProcessor(
        ProcessorContext(AutoConfig.from_pretrained(directory), directory, tokenizer, processor_kwargs or {})
    )


@pytest.fixture(scope="module")
def processor(checkpoint, llm):
    return make_processor(checkpoint[0], llm.get_tokenizer())


def prompt_for(llm, processor, text: str, images: list) -> dict:
    """``text`` with one ``<image>`` per image, tokenized and processed as the server does."""
    processed = processor.process(llm.get_tokenizer().encode(text), images, {})
    return {"prompt_token_ids": processed.prompt_token_ids, "mm_items": processed.items}


def greedy(llm, prompts: list[dict]):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)
    return llm.generate(prompts, params)


# (width, height): 2x2 tiles with padding rows cut, 2x1 tiles with padding columns cut,
# 1x2 tiles with nothing cut, and a square image smaller than one tile
@pytest.mark.parametrize("size", [(40, 30), (16, 60), (56, 27), (20, 20)])
def test_the_prompt_and_tiles_equal_transformers_processor(checkpoint, processor, llm, size):
    from transformers import AutoProcessor

    theirs = AutoProcessor.from_pretrained(checkpoint[0])(
        text=ONE_IMAGE, images=[drawn_image("red", size)], return_tensors="pt"
    )
    ours = prompt_for(llm, processor, ONE_IMAGE, [drawn_image("red", size)])
    assert ours["prompt_token_ids"] == theirs["input_ids"][0].tolist()
    (item,) = ours["mm_items"]
    assert torch.equal(item.data["pixel_values"], theirs["pixel_values"][0])
    assert item.data["image_size"] == tuple(theirs["image_sizes"][0].tolist()) == (size[1], size[0])
    # the start-up worst case holds at least as many feature tokens as any image
    (worst,) = prompt_for(llm, processor, "<image>", processor.dummy_images())["mm_items"]
    assert worst.length == 16 + 8 * 9 >= item.length


def test_greedy_tokens_agree_with_transformers_given_the_same_images(llm, processor, checkpoint):
    hf_model = checkpoint[1]
    cases = [
        (ONE_IMAGE, [drawn_image("red")]),
        (TWO_IMAGES, [drawn_image("blue", (16, 60)), drawn_image("green", (56, 27))]),
    ]
    prompts = [prompt_for(llm, processor, text, images) for text, images in cases]
    # 16 base features; 2x2 tiles cut to 6 rows of 8 (+ newline); 2x1 cut to 8 rows of 2; 1x2 whole
    assert [[item.length for item in prompt["mm_items"]] for prompt in prompts] == [[70], [40, 52]]
    ours = [
        (list(output.outputs[0].token_ids), [set(step) for step in output.outputs[0].logprobs])
        for output in greedy(llm, prompts)
    ]
    theirs = []
    for prompt in prompts:
        items = prompt["mm_items"]
        # transformers batches an image's tiles zero-padded to the most tiles of any image
        most_tiles = max(item.data["pixel_values"].shape[0] for item in items)
        pixel_values = torch.stack(
            [
                torch.cat([pixels, pixels.new_zeros(most_tiles - pixels.shape[0], *pixels.shape[1:])])
                for pixels in (item.data["pixel_values"] for item in items)
            ]
        )
        with torch.no_grad():
            generated = hf_model.generate(
                input_ids=torch.tensor([prompt["prompt_token_ids"]]),
                pixel_values=pixel_values,
                image_sizes=torch.tensor([item.data["image_size"] for item in items]),
                max_new_tokens=NUM_NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        tokens = generated.sequences[0, len(prompt["prompt_token_ids"]) :].tolist()
        theirs.append((tokens, [set(scores[0].topk(5).indices.tolist()) for scores in generated.scores]))
    assert_greedy_agrees(ours, theirs)
    # the images reach the model: another image, the same text, another answer
    other = prompt_for(llm, processor, ONE_IMAGE, [drawn_image("yellow", (16, 60))])
    assert list(greedy(llm, [other])[0].outputs[0].token_ids) != ours[0][0]


def test_the_packed_features_equal_transformers_and_give_the_same_tokens_as_image_embeds(llm, processor, checkpoint):
    from_image = prompt_for(llm, processor, ONE_IMAGE, [drawn_image("red")])
    (item,) = from_image["mm_items"]
    with torch.no_grad():
        (features,) = (
            checkpoint[1]
            .model.get_image_features(
                pixel_values=item.data["pixel_values"].unsqueeze(0),
                image_sizes=torch.tensor([item.data["image_size"]]),
            )
            .pooler_output
        )
    assert features.shape == (70, 64)
    runner = llm.engine.executor.worker.runner
    with torch.no_grad():
        packed = runner.model.embed_multimodal(item, runner.attention_backend)
    torch.testing.assert_close(packed, features, atol=1e-5, rtol=1e-5)  # base, grid, unpadding, newlines in place
    from_embeds = prompt_for(llm, processor, ONE_IMAGE, [ImageEmbeddings(features, "image_embeds")])
    assert from_embeds["prompt_token_ids"] == from_image["prompt_token_ids"]
    ours = greedy(llm, [from_image, from_embeds])
    assert ours[0].outputs[0].token_ids == ours[1].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match=r"image_embeds of shape \(70, 32\)"):
        prompt_for(llm, processor, ONE_IMAGE, [ImageEmbeddings(torch.zeros(70, 32), "messages[0].content[0]")])


def edited_copy(checkpoint_dir: str, directory, **config_changes) -> str:
    """A copy of the checkpoint with ``config_changes`` in its config.json."""
    shutil.copytree(checkpoint_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(config_changes)
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def test_a_processor_or_model_that_cannot_match_the_grid_is_refused(checkpoint, llm, processor, tmp_path):
    with pytest.raises(InvalidRequestError, match=r"base image and 4 tiles of \(28, 28\)"):
        processor.process(
            llm.get_tokenizer().encode(ONE_IMAGE), [drawn_image("red")], {"image_grid_pinpoints": [[56, 84]]}
        )
    half_tiles = edited_copy(checkpoint[0], tmp_path / "half-tiles", image_grid_pinpoints=[[28, 42]])
    with pytest.raises(ModelLoadError, match=r"image_grid_pinpoints \[\[28, 42\]\].*multiple of .* 28-pixel"):
        make_processor(half_tiles, llm.get_tokenizer())
    other = edited_copy(checkpoint[0], tmp_path / "other-pinpoints", image_grid_pinpoints=[[56, 56]])
    with pytest.raises(ModelLoadError, match=r"image processor's image_grid_pinpoints .* are not the model's"):
        make_processor(other, llm.get_tokenizer())
    # the tiles' class tokens do not fit the grid (transformers fails on them too)
    full = edited_copy(checkpoint[0], tmp_path / "full", vision_feature_select_strategy="full")
    with pytest.raises(ConfigError, match="vision_feature_select_strategy 'full': LLaVA-NeXT supports only 'default'"):
        LLM(model=full, **ENGINE)
