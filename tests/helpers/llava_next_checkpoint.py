"""A tiny random LLaVA-NeXT checkpoint as transformers saves one: LLaVA-1.5's tiny CLIP tower
over 28x28 tiles in 7-pixel patches (16 features a tile), image_grid_pinpoints of one to four
tiles, a 2-layer Llama with SmolLM2's tokenizer plus ``<image>``, and a real LlavaNextProcessor
configuration (a LlavaNextImageProcessor and LLaVA-1.5's chat template)."""

from __future__ import annotations

import torch
from helpers.llava_checkpoint import CHAT_TEMPLATE, tiny_text_config

TILE_SIZE = 28
PATCH_SIZE = 7
GRID_PINPOINTS = [[28, 56], [56, 28], [56, 56]]  # (height, width): 1x2, 2x1 and 2x2 tiles


def write_tiny_llava_next(directory, smollm2_gguf: str):
    """Save the checkpoint into ``directory``; returns the transformers model (float32, eval)."""
    from transformers import (
        CLIPVisionConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
    )

    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat

    tokenizer = GGUFLoadFormat().load_tokenizer(smollm2_gguf, None)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=TILE_SIZE,
        patch_size=PATCH_SIZE,
    )
    text = tiny_text_config(tokenizer)
    config = LlavaNextConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_grid_pinpoints=GRID_PINPOINTS,
    )
    torch.manual_seed(0)
    model = LlavaNextForConditionalGeneration(config).eval()
    model.save_pretrained(directory)
    image_processor = LlavaNextImageProcessor(
        size={"shortest_edge": TILE_SIZE},
        crop_size={"height": TILE_SIZE, "width": TILE_SIZE},
        image_grid_pinpoints=GRID_PINPOINTS,
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        num_additional_image_tokens=1,  # the class token, which the default strategy drops
        vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return model
