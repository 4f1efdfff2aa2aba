"""Idefics3 (SmolVLM) offline, on a tiny random checkpoint: the processor's expansion against
transformers' Idefics3Processor (a split image: 2 x 2 tiles and the global image, and one it
does not split), greedy tokens against transformers' ``generate`` with the same images (vLLM's
top-5 rule), a prefill chunk boundary inside an image's span, and an image's embeddings
(``ImageEmbeddings``) giving the same tokens as the image."""

from __future__ import annotations

import pytest
import torch
from helpers.idefics3_checkpoint import IMAGE_SEQ_LEN, TEXT_HIDDEN_SIZE, write_tiny_idefics3
from helpers.llava_checkpoint import drawn_image
from helpers.model_parity import assert_greedy_agrees

from tokenloom import LLM, SamplingParams
from tokenloom.builtin_plugins.models.idefics3_processing import Idefics3Processor
from tokenloom.core.multimodal.processor import ImageEmbeddings, ProcessorContext
from tokenloom.errors import InvalidRequestError

NUM_NEW_TOKENS = 6
ENGINE = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=96, block_size=4)
NO_SPLIT = {"do_image_splitting": False}
QUESTION = "User:<image>What is in the picture?<end_of_utterance>\nAssistant:"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_gguf):
    directory = tmp_path_factory.mktemp("tiny-idefics3")
    hf_model = write_tiny_idefics3(directory, smollm2_gguf)
    return str(directory), hf_model


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(model=checkpoint[0], **ENGINE)


@pytest.fixture(scope="module")
def processor(checkpoint, llm):
    from transformers import AutoConfig

    return Idefics3Processor(
        ProcessorContext(AutoConfig.from_pretrained(checkpoint[0]), checkpoint[0], llm.get_tokenizer(), {})
    )


def prompt_for(llm, processor, text: str, images: list, kwargs: dict | None = None) -> dict:
    """``text`` with one ``<image>`` per image, tokenized and processed as the server does."""
    processed = processor.process(llm.get_tokenizer().encode(text), images, kwargs or {})
    return {"prompt_token_ids": processed.prompt_token_ids, "mm_items": processed.items}


def greedy(llm, prompts: list[dict], num_new_tokens: int = NUM_NEW_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=num_new_tokens, ignore_eos=True, logprobs=5)
    return llm.generate(prompts, params)


@pytest.mark.parametrize("kwargs", [{}, NO_SPLIT], ids=["split", "not-split"])
def test_the_expansion_matches_transformers_processor(checkpoint, llm, processor, kwargs):
    from transformers import AutoProcessor

    hf_processor = AutoProcessor.from_pretrained(checkpoint[0])
    images = [drawn_image("red", (60, 40)), drawn_image("blue", (30, 50))]
    text = "User:<image>and<image>differ?<end_of_utterance>\nAssistant:"
    theirs = hf_processor(text=[text], images=[images], return_tensors="pt", **kwargs)
    ours = prompt_for(llm, processor, text, images, kwargs)
    assert ours["prompt_token_ids"] == theirs["input_ids"][0].tolist()
    frames = 5 if not kwargs else 1  # 2 x 2 tiles and the global image
    assert [item.data["pixel_values"].shape[0] for item in ours["mm_items"]] == [frames, frames]
    assert torch.equal(torch.cat([item.data["pixel_values"] for item in ours["mm_items"]]), theirs["pixel_values"][0])
    image_token_id = processor.image_token_id
    for item in ours["mm_items"]:
        span = ours["prompt_token_ids"][item.offset : item.end]
        assert span[0] == processor.ctx.tokenizer.convert_tokens_to_ids("<fake_token_around_image>")
        assert span.count(image_token_id) == frames * IMAGE_SEQ_LEN


def test_greedy_tokens_agree_with_transformers_given_the_same_images(llm, processor, checkpoint):
    hf_model = checkpoint[1]
    cases = [
        (QUESTION, [drawn_image("red", (60, 40))], {}),
        (
            "User:<image>and<image>which differs?<end_of_utterance>\nAssistant:",
            [drawn_image("blue"), drawn_image("green", (20, 50))],
            {},
        ),
        (QUESTION, [drawn_image("red", (60, 40))], NO_SPLIT),
    ]
    prompts = [prompt_for(llm, processor, text, images, kwargs) for text, images, kwargs in cases]
    ours = [
        (list(output.outputs[0].token_ids), [set(step) for step in output.outputs[0].logprobs])
        for output in greedy(llm, prompts)
    ]
    theirs = []
    for prompt in prompts:
        pixel_values = torch.cat([item.data["pixel_values"] for item in prompt["mm_items"]]).unsqueeze(0)
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
    other = prompt_for(llm, processor, QUESTION, [drawn_image("yellow", (60, 40))])
    assert list(greedy(llm, [other])[0].outputs[0].token_ids) != ours[0][0]


def test_a_prefill_chunk_boundary_inside_an_image_gives_the_same_tokens(checkpoint, llm, processor):
    prompt = prompt_for(llm, processor, QUESTION, [drawn_image("red", (60, 40))])
    item = prompt["mm_items"][0]
    chunk = item.offset + 7  # the first chunk ends inside the first tile's image tokens
    whole = greedy(llm, [prompt])[0].outputs[0].token_ids
    chunked_llm = LLM(model=checkpoint[0], **ENGINE, max_num_batched_tokens=chunk)
    stats = chunked_llm.engine.executor.worker.runner.encoder_cache.stats
    assert greedy(chunked_llm, [prompt])[0].outputs[0].token_ids == whole
    assert stats.encoder_runs == 1  # the image's frames encoded once, sliced per chunk


def test_image_embeddings_give_the_same_tokens_as_the_image(llm, processor, checkpoint):
    image = drawn_image("red", (60, 40))
    from_image = prompt_for(llm, processor, QUESTION, [image], NO_SPLIT)
    pixel_values = from_image["mm_items"][0].data["pixel_values"].unsqueeze(0)
    with torch.no_grad():
        features = checkpoint[1].model.get_image_features(pixel_values).pooler_output[0]
    assert features.shape == (IMAGE_SEQ_LEN, TEXT_HIDDEN_SIZE)
    from_embeds = prompt_for(llm, processor, QUESTION, [ImageEmbeddings(features, "image_embeds")])
    assert from_embeds["prompt_token_ids"] == from_image["prompt_token_ids"]
    ours = greedy(llm, [from_image, from_embeds])
    assert ours[0].outputs[0].token_ids == ours[1].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match=r"content\[0\]: image_embeds of shape \(5, 64\)"):
        prompt_for(llm, processor, QUESTION, [ImageEmbeddings(torch.zeros(5, 64), "messages[0].content[0]")])
