"""LLaVA-1.5 offline, on a tiny random checkpoint: greedy tokens against transformers'
``generate`` with the same images (vLLM's top-5 rule), an image split across prefill chunks,
the encoder cache (a repeated image is encoded once) and prefix-cache keys that hold the
image (same text, another image: no block shared past the text)."""

from __future__ import annotations

import pytest
import torch
from helpers.llava_checkpoint import IMAGE_TOKENS, drawn_image, write_tiny_llava
from helpers.model_parity import assert_greedy_agrees

from tokenloom import LLM, SamplingParams
from tokenloom.builtin_plugins.models.llava_processing import LlavaProcessor
from tokenloom.core.multimodal.processor import ImageEmbeddings, ProcessorContext
from tokenloom.errors import InvalidRequestError

NUM_NEW_TOKENS = 6
ENGINE = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, block_size=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_gguf):
    directory = tmp_path_factory.mktemp("tiny-llava")
    hf_model = write_tiny_llava(directory, smollm2_gguf)
    return str(directory), hf_model


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(model=checkpoint[0], **ENGINE)


@pytest.fixture(scope="module")
def processor(checkpoint, llm):
    from transformers import AutoConfig

    return LlavaProcessor(
        ProcessorContext(AutoConfig.from_pretrained(checkpoint[0]), checkpoint[0], llm.get_tokenizer(), {})
    )


def prompt_for(llm, processor, text: str, images: list) -> dict:
    """``text`` with one ``<image>`` per image, tokenized and processed as the server does."""
    processed = processor.process(llm.get_tokenizer().encode(text), images, {})
    return {"prompt_token_ids": processed.prompt_token_ids, "mm_items": processed.items}


def greedy(llm, prompts: list[dict], num_new_tokens: int = NUM_NEW_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=num_new_tokens, ignore_eos=True, logprobs=5)
    return llm.generate(prompts, params)


def encoder_stats(llm):
    return llm.engine.executor.worker.runner.encoder_cache.stats


def test_greedy_tokens_agree_with_transformers_given_the_same_images(llm, processor, checkpoint):
    hf_model = checkpoint[1]
    cases = [
        ("USER: <image>\nWhat is in the picture? ASSISTANT:", [drawn_image("red")]),
        (
            "USER: <image>\nand <image>\nwhich differs? ASSISTANT:",
            [drawn_image("blue"), drawn_image("green", (20, 50))],
        ),
    ]
    prompts = [prompt_for(llm, processor, text, images) for text, images in cases]
    assert [len(prompt["mm_items"]) for prompt in prompts] == [1, 2]
    assert all(item.length == IMAGE_TOKENS for prompt in prompts for item in prompt["mm_items"])
    ours = [
        (list(output.outputs[0].token_ids), [set(step) for step in output.outputs[0].logprobs])
        for output in greedy(llm, prompts)
    ]
    theirs = []
    for prompt in prompts:
        pixel_values = torch.stack([item.data["pixel_values"] for item in prompt["mm_items"]])
        with torch.no_grad():
            generated = hf_model.generate(
                input_ids=torch.tensor([prompt["prompt_token_ids"]]),
                pixel_values=pixel_values,
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
    other = prompt_for(llm, processor, "USER: <image>\nWhat is in the picture? ASSISTANT:", [drawn_image("yellow")])
    assert list(greedy(llm, [other])[0].outputs[0].token_ids) != ours[0][0]


def test_a_prefill_chunk_boundary_inside_an_image_gives_the_same_tokens(checkpoint, llm, processor):
    prompt = prompt_for(llm, processor, "USER: <image>\nWhat is in the picture? ASSISTANT:", [drawn_image("red")])
    item = prompt["mm_items"][0]
    chunk = item.offset + 2  # the first chunk ends two tokens into the image's placeholders
    whole = greedy(llm, [prompt])[0].outputs[0].token_ids
    chunked_llm = LLM(model=checkpoint[0], **ENGINE, max_num_batched_tokens=chunk)
    assert chunked_llm.engine.scheduler.max_num_batched_tokens == chunk
    before = encoder_stats(chunked_llm).encoder_runs
    assert greedy(chunked_llm, [prompt])[0].outputs[0].token_ids == whole
    assert encoder_stats(chunked_llm).encoder_runs - before == 1  # encoded once, sliced per chunk


def test_the_same_image_twice_is_encoded_once(llm, processor):
    image = drawn_image("purple")
    stats = encoder_stats(llm)
    runs, hits = stats.encoder_runs, stats.hits
    twice = prompt_for(llm, processor, "USER: <image>\n<image>\nSame? ASSISTANT:", [image, image.copy()])
    greedy(llm, [twice], 2)
    assert (stats.encoder_runs - runs, stats.hits - hits) == (1, 1)
    # another request, other text first (a prefix-cache hit would skip the image altogether)
    again = prompt_for(llm, processor, "USER: Look again: <image>\nAgain. ASSISTANT:", [image])
    greedy(llm, [again], 2)
    assert (stats.encoder_runs - runs, stats.hits - hits) == (1, 2)


def test_the_same_text_with_another_image_shares_no_block_past_the_text(llm, processor):
    text = "USER: Here is a long question about colours and shapes. <image>\nWhat colour is the square? ASSISTANT:"
    first = prompt_for(llm, processor, text, [drawn_image("red")])
    offset = first["mm_items"][0].offset
    text_blocks_tokens = offset // 4 * 4  # the full blocks before the image's first placeholder
    red = greedy(llm, [first])[0]
    blue = greedy(llm, [prompt_for(llm, processor, text, [drawn_image("blue")])])[0]
    red_again = greedy(llm, [prompt_for(llm, processor, text, [drawn_image("red")])])[0]
    assert blue.num_cached_tokens == text_blocks_tokens
    assert red_again.num_cached_tokens > text_blocks_tokens  # the same image: its blocks are shared
    assert red_again.outputs[0].token_ids == red.outputs[0].token_ids

    def first_logprob(output) -> float:
        completion = output.outputs[0]
        return completion.logprobs[0][completion.token_ids[0]].logprob

    # the image still decides: the first token's probability moves with it (the long text
    # dominates this random model's greedy choice)
    assert first_logprob(red_again) == pytest.approx(first_logprob(red), abs=1e-5)
    assert abs(first_logprob(blue) - first_logprob(red)) > 1e-3


def test_image_embeddings_give_the_same_tokens_as_the_image(llm, processor, checkpoint):
    text = "USER: <image>\nWhat is in the picture? ASSISTANT:"
    from_image = prompt_for(llm, processor, text, [drawn_image("red")])
    pixel_values = from_image["mm_items"][0].data["pixel_values"].unsqueeze(0)
    with torch.no_grad():
        features = checkpoint[1].model.get_image_features(pixel_values=pixel_values).pooler_output[0]
    assert features.shape[0] == IMAGE_TOKENS
    from_embeds = prompt_for(llm, processor, text, [ImageEmbeddings(features, "image_embeds")])
    assert from_embeds["prompt_token_ids"] == from_image["prompt_token_ids"]
    ours = greedy(llm, [from_image, from_embeds])
    assert ours[0].outputs[0].token_ids == ours[1].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match=r"image_embeds of shape \(4, 32\)"):
        prompt_for(llm, processor, text, [ImageEmbeddings(torch.zeros(4, 32), "messages[0].content[0]")])
