"""Gemma 3's multimodal processor: each image through the checkpoint's Gemma3 image processor
(resized to the vision tower's square, rescaled and normalised; pan and scan is refused), and
the ``<start_of_image>`` the chat template renders for it expanded as transformers'
Gemma3Processor does: a blank line, ``<start_of_image>``, ``mm_tokens_per_image`` image tokens,
``<end_of_image>``, a blank line. Transformers tokenizes that text with its neighbours, so a
blank line beside a newline of the prompt becomes one longer newline token here too.

The item covers the image tokens alone; they attend to each other both ways
(``bidirectional``), as transformers' ``token_type_ids`` mask has them. ``image_embeds`` stand
for the projector's output: ``mm_tokens_per_image`` rows.
"""

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

# the newlines Gemma3Processor puts before and after an image's tokens
BLANK_LINE = 2
# the longest newline run a tokenizer's newline tokens are looked up for
MAX_NEWLINE_RUN = 32


class Gemma3Processor(MultiModalProcessor):
    takes_image_embeds = True

    def __init__(self, ctx: ProcessorContext):
        super().__init__(ctx)
        from transformers import AutoImageProcessor

        config = ctx.hf_config
        tokenizer = ctx.tokenizer
        self.boi_token_id = config.boi_token_index
        self.eoi_token_id = config.eoi_token_index
        self.image_token_id = config.image_token_index
        self.placeholders = {"image": tokenizer.convert_ids_to_tokens(self.boi_token_id)}
        self.num_image_tokens = config.mm_tokens_per_image
        self.image_size = config.vision_config.image_size
        self.hidden_size = config.text_config.hidden_size
        try:
            self.image_processor = AutoImageProcessor.from_pretrained(ctx.model_path)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(
                f"{ctx.model_path} has no image processor configuration Gemma 3 can read: {exc}"
            ) from None
        # newline count -> the tokenizer's one token for that many newlines
        self.newline_token_ids: dict[int, int] = {}
        for count in range(1, MAX_NEWLINE_RUN + 1):
            ids = tokenizer.encode("\n" * count, add_special_tokens=False)
            if len(ids) == 1:
                self.newline_token_ids[count] = ids[0]
        if BLANK_LINE not in self.newline_token_ids:
            raise ModelLoadError("the Gemma 3 tokenizer has no token for a blank line (two newlines)")
        self.newline_counts = {token_id: count for count, token_id in self.newline_token_ids.items()}

    def dummy_images(self) -> list[Any]:
        """Every image is resized to the tower's square: any one is the worst case."""
        from PIL import Image

        return [Image.new("RGB", (self.image_size, self.image_size))]

    def process(
        self, prompt_token_ids: list[int], images: list[Any], processor_kwargs: dict[str, Any]
    ) -> ProcessedPrompt:
        if processor_kwargs.get("do_pan_and_scan", getattr(self.image_processor, "do_pan_and_scan", False)):
            raise InvalidRequestError(
                "do_pan_and_scan is not supported for Gemma 3 here: each image is one crop of the vision tower's "
                "size; set mm_processor_kwargs do_pan_and_scan to false",
                param="mm_processor_kwargs",
            )

        def expand(image: Any) -> PlaceholderExpansion:
            if isinstance(image, ImageEmbeddings):
                data = {"image_embeds": image.checked(self.num_image_tokens, self.hidden_size)}
                content_hash = image.hash()
            else:
                data = {"pixel_values": self.pixel_values(image, processor_kwargs)}
                content_hash = image_hash(image, processor_kwargs)
            token_ids = [self.boi_token_id, *[self.image_token_id] * self.num_image_tokens, self.eoi_token_id]
            return PlaceholderExpansion(
                token_ids, content_hash, data, item_start=1, item_length=self.num_image_tokens, bidirectional=True
            )

        return splice_placeholders(
            self.with_blank_lines(prompt_token_ids), self.boi_token_id, images, expand, self.placeholders["image"]
        )

    def pixel_values(self, image: Any, processor_kwargs: dict[str, Any]) -> Any:
        """One image as the tower takes it, ``[3, image_size, image_size]``."""
        try:
            processed = self.image_processor(images=[image], return_tensors="pt", **processor_kwargs)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(
                f"mm_processor_kwargs {processor_kwargs!r} do not suit the image processor: {exc}",
                param="mm_processor_kwargs",
            ) from None
        pixel_values = processed["pixel_values"][0]
        if tuple(pixel_values.shape[-2:]) != (self.image_size, self.image_size):
            raise InvalidRequestError(
                f"the image processor made a {tuple(pixel_values.shape[-2:])} image, but the vision tower takes "
                f"{self.image_size} x {self.image_size}: leave the image processor's size as it is",
                param="mm_processor_kwargs",
            )
        return pixel_values

    def with_blank_lines(self, prompt_token_ids: list[int]) -> list[int]:
        """``prompt_token_ids`` with a blank line before and after each ``<start_of_image>``
        (where its expansion puts them), each run of newlines then one token as the tokenizer
        gives it."""
        token_ids: list[int] = []
        pending_newlines = 0
        for token_id in prompt_token_ids:
            if token_id in self.newline_counts:
                pending_newlines += self.newline_counts[token_id]
                continue
            if token_id == self.boi_token_id:
                pending_newlines += BLANK_LINE
            token_ids += self.newline_run(pending_newlines)
            pending_newlines = BLANK_LINE if token_id == self.boi_token_id else 0
            token_ids.append(token_id)
        return token_ids + self.newline_run(pending_newlines)

    def newline_run(self, count: int) -> list[int]:
        """The fewest newline tokens for ``count`` newlines, longest first."""
        token_ids = []
        while count:
            longest = max(length for length in self.newline_token_ids if length <= count)
            token_ids.append(self.newline_token_ids[longest])
            count -= longest
        return token_ids
