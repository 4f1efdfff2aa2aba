"""Tiny random Qwen2-VL and Qwen2.5-VL checkpoints as transformers saves them: a 2-block vision
tower (14-pixel patches merged 2x2; Qwen2.5-VL's with one windowed and one full-attention block
and 2x2-token windows), a 2-layer Qwen2 language model with M-RoPE over SmolLM2's tokenizer plus
Qwen's vision tokens, and a real processor configuration (``Qwen2VLImageProcessorPil`` with small
``min_pixels``/``max_pixels``, so a small image gives a few dozen tokens) whose chat template
renders each image as ``<|vision_start|><|image_pad|><|vision_end|>``."""

from __future__ import annotations

import torch
from helpers.model_parity import randomize_parameters

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MIN_PIXELS = 56 * 56  # at least 4 x 4 patches: 4 tokens
MAX_PIXELS = 28 * 28 * 64  # at most 64 tokens


def write_tiny_qwen2_vl(directory, smollm2_gguf: str, *, qwen2_5: bool = False):
    """Save the checkpoint into ``directory``; returns the transformers model (float32, eval)."""
    import transformers

    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat

    tokenizer = GGUFLoadFormat().load_tokenizer(smollm2_gguf, None)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    start, end, image_pad, video_pad = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    common_vision = dict(depth=2, num_heads=4, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    tokens = dict(
        image_token_id=image_pad, video_token_id=video_pad, vision_start_token_id=start, vision_end_token_id=end
    )
    if qwen2_5:
        vision = dict(
            hidden_size=32,
            intermediate_size=48,
            out_hidden_size=64,
            hidden_act="silu",
            window_size=56,  # 2 x 2 merged tokens a window
            fullatt_block_indexes=[1],
            **common_vision,
        )
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
        model_class = transformers.Qwen2_5_VLForConditionalGeneration
    else:
        vision = dict(embed_dim=32, hidden_size=64, mlp_ratio=2, **common_vision)
        config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
        model_class = transformers.Qwen2VLForConditionalGeneration
    torch.manual_seed(0)
    model = randomize_parameters(model_class(config), std=1.5).eval()
    model.save_pretrained(directory)
    # the PIL image processor, saved alone: the default one and Qwen2VLProcessor (through its
    # video processor) need torchvision, which the test environment lacks
    transformers.Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return model


def hf_inputs(directory, tokenizer, prompt: str, images: list) -> dict:
    """What ``Qwen2VLProcessor`` gives transformers' model for ``prompt`` and ``images`` (its
    rule: each ``<|image_pad|>`` repeated ``t * h * w / merge**2`` times, the image grid from the
    image processor), built here because the processor class needs torchvision."""
    from transformers import AutoImageProcessor

    image_inputs = AutoImageProcessor.from_pretrained(directory)(images=images, return_tensors="pt")
    counts = iter((image_inputs["image_grid_thw"].prod(-1) // 4).tolist())
    pad = "<|image_pad|>"
    expanded = "".join(
        piece + (pad * next(counts) if index < prompt.count(pad) else "")
        for index, piece in enumerate(prompt.split(pad))
    )
    input_ids = torch.tensor([tokenizer.encode(expanded, add_special_tokens=False)])
    image_token_id = tokenizer.convert_tokens_to_ids(pad)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": (input_ids == image_token_id).int(),
        **image_inputs,
    }


def hf_greedy(model, inputs: dict, num_new_tokens: int) -> tuple[list[int], list[set[int]]]:
    """transformers' greedy tokens and each step's top-5 token ids for processor ``inputs``."""
    with torch.no_grad():
        generated = model.generate(
            **inputs,
            max_new_tokens=num_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = generated.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return tokens, [set(scores[0].topk(5).indices.tolist()) for scores in generated.scores]
