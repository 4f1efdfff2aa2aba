"""Qwen2-VL's and Qwen2.5-VL's multimodal processor: dynamic resolution. Each image goes through
the checkpoint's image processor (transformers' ``Qwen2VLImageProcessor``: resized to multiples
of ``patch_size * merge_size`` with its pixel count between ``min_pixels`` and ``max_pixels``,
from the processor config or ``mm_processor_kwargs``, cut into patches), and the one
``<|image_pad|>`` the chat template renders for it (between ``<|vision_start|>`` and
``<|vision_end|>``) becomes one pad per merged patch. Each item carries its patch grid and its
M-RoPE grid (:data:`~tokenloom.core.multimodal.mrope.MROPE_GRID`)."""

from __future__ import annotations

import math
from typing import Any

from tokenloom.plugin_api import (
    MROPE_GRID,
    InvalidRequestError,
    ModelLoadError,
    MultiModalProcessor,
    PlaceholderExpansion,
    ProcessedPrompt,
    ProcessorContext,
    image_hash,
    splice_placeholders,
)


class Qwen2VLProcessor(MultiModalProcessor):
    def __init__(self, ctx: ProcessorContext):
        super().__init__(ctx)
        from transformers import AutoImageProcessor

        config = ctx.hf_config
        self.image_token_id = getattr(config, "image_token_id", None)
        if self.image_token_id is None:
            raise ModelLoadError("the Qwen2-VL config names no image token (image_token_id)")
        tokenizer = ctx.tokenizer
        image_pad = tokenizer.convert_ids_to_tokens(self.image_token_id)
        start, end = tokenizer.convert_ids_to_tokens([config.vision_start_token_id, config.vision_end_token_id])
        self.placeholders = {"image": f"{start}{image_pad}{end}"}
        try:
            self.image_processor = AutoImageProcessor.from_pretrained(ctx.model_path)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(
                f"{ctx.model_path} has no image processor configuration Qwen2-VL can read: {exc}"
            ) from None
        self.merge_size = config.vision_config.spatial_merge_size

    def _call_kwargs(self, processor_kwargs: dict[str, Any]) -> dict[str, Any]:
        """``min_pixels``/``max_pixels`` (vLLM's and the model card's names) as the image
        processor's ``size`` bounds; every other option passed as it is."""
        kwargs = dict(processor_kwargs)
        bounds = {"shortest_edge": kwargs.pop("min_pixels", None), "longest_edge": kwargs.pop("max_pixels", None)}
        for name, value in zip(("min_pixels", "max_pixels"), bounds.values(), strict=True):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidRequestError(
                    f"mm_processor_kwargs {name} must be a positive whole number of pixels, not {value!r}",
                    param="mm_processor_kwargs",
                )
        if any(value is not None for value in bounds.values()):
            size = dict(kwargs.pop("size", None) or self.image_processor.size)
            size.update({key: value for key, value in bounds.items() if value is not None})
            kwargs["size"] = size
        return kwargs

    def dummy_images(self) -> list[Any]:
        from PIL import Image

        factor = self.image_processor.patch_size * self.merge_size
        side = max(factor, math.isqrt(int(self.image_processor.size["longest_edge"])) // factor * factor)
        return [Image.new("RGB", (side, side))]

    def process(
        self, prompt_token_ids: list[int], images: list[Any], processor_kwargs: dict[str, Any]
    ) -> ProcessedPrompt:
        from huggingface_hub.errors import StrictDataclassError

        call_kwargs = self._call_kwargs(processor_kwargs)

        def expand(image: Any) -> PlaceholderExpansion:
            try:
                processed = self.image_processor(images=[image], return_tensors="pt", **call_kwargs)
            except (TypeError, ValueError, KeyError, StrictDataclassError) as exc:
                raise InvalidRequestError(
                    f"mm_processor_kwargs {processor_kwargs!r} do not suit the image processor: {exc}",
                    param="mm_processor_kwargs",
                ) from None
            frames, height, width = (int(size) for size in processed["image_grid_thw"][0])
            grid = (frames, height // self.merge_size, width // self.merge_size)
            data = {
                "pixel_values": processed["pixel_values"],
                "image_grid_thw": (frames, height, width),
                MROPE_GRID: grid,
            }
            return PlaceholderExpansion(
                [self.image_token_id] * math.prod(grid), image_hash(image, processor_kwargs), data
            )

        return splice_placeholders(prompt_token_ids, self.image_token_id, images, expand, self.placeholders["image"])
