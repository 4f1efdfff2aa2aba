"""A tiny random Gemma 3 (``Gemma3ForConditionalGeneration``) checkpoint as transformers saves one:
a 2-layer SigLIP tower over 32x32 images in 4-pixel patches (8 x 8 patches, pooled to 4 x 4:
16 image tokens), a 4-layer Gemma 3 language model whose sliding window (8 tokens) is shorter
than an image, Gemma 3's own tokenizer (from the gemma-3-270m GGUF, plus the
``<image_soft_token>`` that file lacks) and a real Gemma3Processor configuration with a
Gemma-style chat template that renders image parts."""

from __future__ import annotations

import torch

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
IMAGE_SIZE = 32
IMAGE_TOKENS = 16  # (32 / 4) ** 2 patches pooled 2 x 2
TEXT_HIDDEN_SIZE = 64
SLIDING_WINDOW = 8


def gemma3_tokenizer():
    """Gemma 3's tokenizer with its image tokens named as Gemma3Processor reads them."""
    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat
    from tokenloom.builtin_plugins.model_sources.pip_packages import PipPackageModelSource

    tokenizer = GGUFLoadFormat().load_tokenizer(PipPackageModelSource().resolve("gemma3-270m").path, None)
    tokenizer.add_special_tokens({"extra_special_tokens": ["<image_soft_token>"]})
    # the named image tokens a released Gemma 3 tokenizer_config.json carries (saved with it)
    tokenizer._set_model_specific_special_tokens(
        {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    )
    return tokenizer


def write_tiny_gemma3(directory, *, seed: int = 0):
    """Save the checkpoint into ``directory``; returns the transformers model (float32, eval)."""
    from helpers.model_parity import randomize_parameters
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    tokenizer = gemma3_tokenizer()
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=4,
        vision_use_head=False,
    )
    text = Gemma3TextConfig(
        vocab_size=262_208,  # Gemma 3 4B's: the image token (262144) included
        hidden_size=TEXT_HIDDEN_SIZE,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=SLIDING_WINDOW,
        max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=IMAGE_TOKENS,
        image_token_index=tokenizer.convert_tokens_to_ids("<image_soft_token>"),
    )
    torch.manual_seed(seed)
    model = randomize_parameters(Gemma3ForConditionalGeneration(config), seed=seed, std=1.0).eval()
    model.save_pretrained(directory)
    image_processor = Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_length=IMAGE_TOKENS, chat_template=CHAT_TEMPLATE
    )
    processor.save_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return model
