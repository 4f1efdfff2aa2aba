"""LLaVA-1.5's multimodal processor: each image through the checkpoint's CLIP image processor
(resize, centre crop, normalise), and its one ``<image>`` token in the rendered prompt expanded
to one token per image feature (a patch of the vision tower, plus the class token under the
``full`` strategy). ``image_embeds`` stand for the projector's output: one row per feature."""

from __future__ import annotations

from typing import Any

from tokenloom.plugin_api import (
    ImageEmbeddings,
    InvalidRequestError,
    ModelLoadError,
    MultiModalProcessor,
    PlaceholderExpansion,
    ProcessedPrompt,
    ProcessorContext,
    image_hash,
    splice_placeholders,
)


class LlavaProcessor(MultiModalProcessor):
    takes_image_embeds = True

    def __init__(self, ctx: ProcessorContext):
        super().__init__(ctx)
        from transformers import AutoImageProcessor

        config = ctx.hf_config
        token_id = getattr(config, "image_token_index", None)
        self.image_token_id = token_id if token_id is not None else getattr(config, "image_token_id", None)
        if self.image_token_id is None:
            raise ModelLoadError("the LLaVA config names no image token (image_token_index)")
        self.placeholders = {"image": ctx.tokenizer.convert_ids_to_tokens(self.image_token_id)}
        try:
            self.image_processor = AutoImageProcessor.from_pretrained(ctx.model_path)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(
                f"{ctx.model_path} has no image processor configuration LLaVA can read: {exc}"
            ) from None
        self.patch_size = config.vision_config.patch_size
        self.extra_tokens = 1 if config.vision_feature_select_strategy == "full" else 0

    def dummy_images(self) -> list[Any]:
        from PIL import Image

        size = self.ctx.hf_config.vision_config.image_size
        return [Image.new("RGB", (size, size))]

    def process(
        self, prompt_token_ids: list[int], images: list[Any], processor_kwargs: dict[str, Any]
    ) -> ProcessedPrompt:
        def expand(image: Any) -> PlaceholderExpansion:
            content_hash, length, data = self.image_inputs(image, processor_kwargs)
            return PlaceholderExpansion([self.image_token_id] * length, content_hash, data)

        return splice_placeholders(prompt_token_ids, self.image_token_id, images, expand, self.placeholders["image"])

    def image_inputs(self, image: Any, processor_kwargs: dict[str, Any]) -> tuple[str, int, dict[str, Any]]:
        """An image's (or its embeddings') hash, feature tokens and item data."""
        if isinstance(image, ImageEmbeddings):
            config = self.ctx.hf_config
            length = (config.vision_config.image_size // self.patch_size) ** 2 + self.extra_tokens
            return image.hash(), length, {"image_embeds": image.checked(length, config.text_config.hidden_size)}
        try:
            pixel_values = self.image_processor(images=[image], return_tensors="pt", **processor_kwargs)[
                "pixel_values"
            ][0]
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(
                f"mm_processor_kwargs {processor_kwargs!r} do not suit the image processor: {exc}",
                param="mm_processor_kwargs",
            ) from None
        height, width = pixel_values.shape[-2:]
        length = (height // self.patch_size) * (width // self.patch_size) + self.extra_tokens
        return image_hash(image, processor_kwargs), length, {"pixel_values": pixel_values}
