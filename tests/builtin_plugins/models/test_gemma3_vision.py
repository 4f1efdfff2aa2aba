"""Gemma 3 with its SigLIP tower offline, on a tiny random checkpoint whose sliding window (8)
is shorter than an image (16 tokens): the processor's expansion against transformers'
Gemma3Processor (blank lines merged into the prompt's newlines), greedy tokens against
transformers' ``generate`` with one and two images (its image tokens attend to each other both
ways: the parity needs that mask), a chunked prefill whose budget ends inside an image (the
scheduler keeps the image whole), image embeddings giving the image's tokens, and pan and scan
refused by name."""

from __future__ import annotations

import pytest
import torch
from helpers.gemma3_checkpoint import IMAGE_TOKENS, TEXT_HIDDEN_SIZE, write_tiny_gemma3
from helpers.llava_checkpoint import drawn_image
from helpers.model_parity import assert_greedy_agrees

from tokenloom import LLM, SamplingParams
from tokenloom.builtin_plugins.models.gemma3_processing import Gemma3Processor
from tokenloom.core.multimodal.processor import ImageEmbeddings, ProcessorContext
from tokenloom.errors import InvalidRequestError

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 6
ENGINE = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, block_size=4)
ONE_IMAGE = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
TWO_IMAGES = [
    {"type": "text", "text": "Compare\n"},
    {"type": "image"},
    {"type": "text", "text": "and"},
    {"type": "image"},
    {"type": "text", "text": "please."},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-gemma3")
    hf_model = write_tiny_gemma3(directory)
    return str(directory), hf_model


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(model=checkpoint[0], **ENGINE)


@pytest.fixture(scope="module")
def hf_processor(checkpoint):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(checkpoint[0])


@pytest.fixture(scope="module")
def processor(checkpoint, llm):
    from transformers import AutoConfig

    return Gemma3Processor(
        ProcessorContext(AutoConfig.from_pretrained(checkpoint[0]), checkpoint[0], llm.get_tokenizer(), {})
    )


def chat_text(hf_processor, content: list[dict]) -> str:
    conversation = [{"role": "user", "content": content}]
    return hf_processor.apply_chat_template(conversation, add_generation_prompt=True)


def prompt_for(llm, processor, text: str, images: list, kwargs: dict | None = None) -> dict:
    """``text`` tokenized and processed as the server does a chat prompt."""
    token_ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    processed = processor.process(token_ids, images, kwargs or {})
    return {"prompt_token_ids": processed.prompt_token_ids, "mm_items": processed.items}


def greedy_outputs(llm, prompts: list[dict]):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)
    return [output.outputs[0] for output in llm.generate(prompts, params)]


def greedy(llm, prompts: list[dict]):
    return [
        (list(output.token_ids), [set(step) for step in output.logprobs]) for output in greedy_outputs(llm, prompts)
    ]


def transformers_first_logprobs(hf_model, inputs) -> torch.Tensor:
    """The log-probabilities of the first token after the prompt."""
    with torch.no_grad():
        return hf_model(**inputs).logits[0, -1].log_softmax(-1)


def transformers_greedy(hf_model, inputs) -> tuple[list[int], list[set[int]]]:
    with torch.no_grad():
        generated = hf_model.generate(
            **inputs,
            max_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    return (
        generated.sequences[0, inputs["input_ids"].shape[1] :].tolist(),
        [set(scores[0].topk(5).indices.tolist()) for scores in generated.scores],
    )


CASES = [
    (ONE_IMAGE, [drawn_image("red", (60, 40))]),
    (TWO_IMAGES, [drawn_image("blue"), drawn_image("green", (20, 50))]),
]


def test_the_expansion_matches_transformers_processor(llm, processor, hf_processor):
    for content, images in CASES:
        text = chat_text(hf_processor, content)
        theirs = hf_processor(text=[text], images=[images], return_tensors="pt", add_special_tokens=False)
        ours = prompt_for(llm, processor, text, images)
        assert ours["prompt_token_ids"] == theirs["input_ids"][0].tolist()
        # the items are exactly the image tokens transformers' mask lets attend both ways
        image_positions = theirs["token_type_ids"][0].nonzero()[:, 0].tolist()
        assert [p for item in ours["mm_items"] for p in range(item.offset, item.end)] == image_positions
        assert all(item.bidirectional and item.length == IMAGE_TOKENS for item in ours["mm_items"])
        pixel_values = torch.stack([item.data["pixel_values"] for item in ours["mm_items"]])
        assert torch.equal(pixel_values, theirs["pixel_values"])


def test_greedy_tokens_agree_with_transformers_given_the_same_images(llm, processor, hf_processor, checkpoint):
    prompts, theirs, their_first_logprobs = [], [], []
    for content, images in CASES:
        text = chat_text(hf_processor, content)
        prompts.append(prompt_for(llm, processor, text, images))
        inputs = hf_processor(text=[text], images=[images], return_tensors="pt", add_special_tokens=False)
        theirs.append(transformers_greedy(checkpoint[1], inputs))
        their_first_logprobs.append(transformers_first_logprobs(checkpoint[1], inputs))
    outputs = greedy_outputs(llm, prompts)
    ours = [(list(output.token_ids), [set(step) for step in output.logprobs]) for output in outputs]
    assert_greedy_agrees(ours, theirs)
    # the first token's top-5 log-probabilities as transformers computes them, with its image
    # tokens attending to each other both ways (a causal mask alone misses by far more)
    for output, their_logprobs in zip(outputs, their_first_logprobs, strict=True):
        for token_id, logprob in output.logprobs[0].items():
            assert logprob.logprob == pytest.approx(their_logprobs[token_id].item(), abs=1e-3)
    # the images reach the model: another image, the same text, another answer
    other = prompt_for(llm, processor, chat_text(hf_processor, ONE_IMAGE), [drawn_image("yellow", (60, 40))])
    assert greedy(llm, [other])[0][0] != ours[0][0]


def test_a_prefill_budget_ending_inside_an_image_computes_the_image_whole(checkpoint, llm, processor, hf_processor):
    prompt = prompt_for(llm, processor, chat_text(hf_processor, ONE_IMAGE), [drawn_image("red", (60, 40))])
    item = prompt["mm_items"][0]
    whole = greedy(llm, [prompt])[0][0]
    budget = IMAGE_TOKENS + 2
    assert item.offset < budget < item.end
    # the first chunk would end inside the image: it ends before the image instead
    chunked_llm = LLM(model=checkpoint[0], **ENGINE, max_num_batched_tokens=budget)
    assert greedy(chunked_llm, [prompt])[0][0] == whole
    # an image longer than a step's chunk could never run whole: refused at admission
    small_llm = LLM(model=checkpoint[0], **ENGINE, max_num_batched_tokens=IMAGE_TOKENS - 1)
    with pytest.raises(InvalidRequestError, match=r"raise --max-num-batched-tokens .* to at least 16"):
        greedy(small_llm, [prompt])


def test_image_embeddings_give_the_same_tokens_as_the_image(llm, processor, hf_processor, checkpoint):
    image = drawn_image("red", (60, 40))
    text = chat_text(hf_processor, ONE_IMAGE)
    from_image = prompt_for(llm, processor, text, [image])
    with torch.no_grad():
        pixel_values = from_image["mm_items"][0].data["pixel_values"].unsqueeze(0)
        features = checkpoint[1].model.get_image_features(pixel_values).pooler_output[0]
    assert features.shape == (IMAGE_TOKENS, TEXT_HIDDEN_SIZE)
    from_embeds = prompt_for(llm, processor, text, [ImageEmbeddings(features, "image_embeds")])
    assert from_embeds["prompt_token_ids"] == from_image["prompt_token_ids"]
    ours = greedy(llm, [from_image, from_embeds])
    assert ours[0][0] == ours[1][0]


def test_pan_and_scan_is_refused_by_name(llm, processor, hf_processor):
    text = chat_text(hf_processor, ONE_IMAGE)
    with pytest.raises(InvalidRequestError, match="do_pan_and_scan is not supported") as raised:
        prompt_for(llm, processor, text, [drawn_image("red")], {"do_pan_and_scan": True})
    assert raised.value.param == "mm_processor_kwargs"
