"""Idefics3's (SmolVLM's) multimodal processor: each image through the checkpoint's Idefics3
image processor (resized to its longest edge, split into square tiles of the vision tower's
size in rows and columns, plus the whole image squared: the global image), and its one
``<image>`` token in the rendered prompt expanded as transformers' Idefics3Processor does:
per tile ``<fake_token_around_image><row_r_col_c>`` and ``image_seq_len`` ``<image>`` tokens,
a line break after each row, then a blank line and
``<fake_token_around_image><global-img>``, the global image's tokens and a closing
``<fake_token_around_image>`` (an image the processor does not split: that last part alone).

The item spans the whole expansion; the model fills its ``<image>`` rows with the frames'
features and the others with the markers' token embeddings. ``image_embeds`` stand for an
image the processor does not split: one frame's ``image_seq_len`` rows.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenloom.builtin_plugins.models.modeling_idefics3 import image_seq_len
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

FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"


class Idefics3Processor(MultiModalProcessor):
    takes_image_embeds = True

    def __init__(self, ctx: ProcessorContext):
        super().__init__(ctx)
        from transformers import AutoImageProcessor

        config = ctx.hf_config
        tokenizer = ctx.tokenizer
        self.image_token_id = config.image_token_id
        self.image_token = tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.placeholders = {"image": self.image_token}
        markers = [FAKE_TOKEN, GLOBAL_TOKEN, "<row_1_col_1>"]
        unknown = [
            marker for marker in markers if tokenizer.convert_tokens_to_ids(marker) in (None, tokenizer.unk_token_id)
        ]
        if unknown:
            raise ModelLoadError(f"the Idefics3 tokenizer lacks the image marker token(s) {', '.join(unknown)}")
        options = getattr(config, "image_processor_config", None)
        if options is not None:  # a GGUF model's --mmproj file carries the settings
            from transformers import Idefics3ImageProcessor

            self.image_processor = Idefics3ImageProcessor(**options)
        else:
            try:
                self.image_processor = AutoImageProcessor.from_pretrained(ctx.model_path)
            except (OSError, ValueError) as exc:
                raise ModelLoadError(
                    f"{ctx.model_path} has no image processor configuration Idefics3 can read: {exc}"
                ) from None
        self.image_seq_len = image_seq_len(config)
        self.frame_size = config.vision_config.image_size
        self.hidden_size = config.text_config.hidden_size
        self._span_token_ids: dict[tuple[int, int], list[int]] = {}

    def dummy_images(self) -> list[Any]:
        """The largest image the processor keeps: the most tiles."""
        from PIL import Image

        edge = (self.image_processor.size or {}).get("longest_edge", self.frame_size)
        return [Image.new("RGB", (edge, edge))]

    def span_token_ids(self, rows: int, cols: int) -> list[int]:
        """The expansion of one image split into ``rows`` x ``cols`` tiles (0 x 0: not split)."""
        if (rows, cols) not in self._span_token_ids:
            frame = self.image_token * self.image_seq_len
            text = f"{FAKE_TOKEN}{GLOBAL_TOKEN}{frame}{FAKE_TOKEN}"
            if rows or cols:
                tiles = "".join(
                    "".join(f"{FAKE_TOKEN}<row_{row}_col_{col}>{frame}" for col in range(1, cols + 1)) + "\n"
                    for row in range(1, rows + 1)
                )
                text = f"{tiles}\n{text}"
            self._span_token_ids[rows, cols] = list(self.ctx.tokenizer.encode(text, add_special_tokens=False))
        return self._span_token_ids[rows, cols]

    def frames(self, image: Any, processor_kwargs: dict[str, Any]) -> tuple[torch.Tensor, int, int]:
        """An image's frames ``[frames, 3, size, size]`` (tiles, then the global image) and its rows and columns."""
        try:
            processed = self.image_processor(
                images=[[image]], return_tensors="pt", return_row_col_info=True, **processor_kwargs
            )
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(
                f"mm_processor_kwargs {processor_kwargs!r} do not suit the image processor: {exc}",
                param="mm_processor_kwargs",
            ) from None
        pixel_values = processed["pixel_values"][0]
        rows, cols = processed["rows"][0][0], processed["cols"][0][0]
        if tuple(pixel_values.shape[-2:]) != (self.frame_size, self.frame_size):
            raise InvalidRequestError(
                f"the image processor made {tuple(pixel_values.shape[-2:])} frames, but the vision tower takes "
                f"{self.frame_size} x {self.frame_size}: max_image_size must keep its longest_edge at {self.frame_size}",
                param="mm_processor_kwargs",
            )
        return pixel_values, rows, cols

    def process(
        self, prompt_token_ids: list[int], images: list[Any], processor_kwargs: dict[str, Any]
    ) -> ProcessedPrompt:
        def expand(image: Any) -> PlaceholderExpansion:
            if isinstance(image, ImageEmbeddings):
                data = {"image_embeds": image.checked(self.image_seq_len, self.hidden_size)}
                rows = cols = 0
                content_hash = image.hash()
            else:
                pixel_values, rows, cols = self.frames(image, processor_kwargs)
                data = {"pixel_values": pixel_values}
                content_hash = image_hash(image, processor_kwargs)
            span = self.span_token_ids(rows, cols)
            data["token_ids"] = torch.tensor(span)
            return PlaceholderExpansion(span, content_hash, data)

        return splice_placeholders(prompt_token_ids, self.image_token_id, images, expand, self.image_token)
