"""A tiny random LLaVA-1.5 checkpoint as transformers saves one (a CLIP vision tower of 2
layers over 28x28 images in 14-pixel patches: 4 image tokens; a 2-layer Llama with SmolLM2's
tokenizer plus an ``<image>`` token; a real LlavaProcessor configuration with a
CLIPImageProcessor and a chat template that renders image parts), and synthetic PNG images."""

from __future__ import annotations

import base64
import io

import torch
from helpers.tiny_llama import tiny_llama_config

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
IMAGE_TOKENS = 4  # (28 / 14) ** 2 patches, the class token dropped


def tiny_text_config(tokenizer):
    """The tiny Llama the LLaVA checkpoints' language side is, over ``tokenizer``'s vocabulary."""
    return tiny_llama_config(tokenizer, max_position_embeddings=512, tie_word_embeddings=False)


def write_tiny_llava(directory, smollm2_gguf: str):
    """Save the checkpoint into ``directory``; returns the transformers model (float32, eval)."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat

    tokenizer = GGUFLoadFormat().load_tokenizer(smollm2_gguf, None)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=28, patch_size=14
    )
    text = tiny_text_config(tokenizer)
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_seq_length=IMAGE_TOKENS,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    model.save_pretrained(directory)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        num_additional_image_tokens=1,  # the class token, which the default strategy drops (as llava-1.5's)
        vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return model


def drawn_image(color: str, size=(40, 30)):
    """A white image with a filled square of ``color``."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).rectangle([5, 5, 20, 20], fill=color)
    return image


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
