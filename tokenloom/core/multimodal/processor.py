"""The multimodal processor interface (:class:`MultiModalProcessor`): what a model plugin that
sees registers beside its model (``register_models``' ``multimodal_processor=`` option). The
server builds one per model; for each request it expands the chat template's placeholder
token of every image into the image's feature tokens and turns each image into the encoder
inputs the model embeds (:class:`~tokenloom.core.multimodal.inputs.MultiModalItem`).

The split follows vLLM's: what the processor declares about the model (placeholders, limits
per prompt, a worst-case input), and the processing itself. No torch at import.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from tokenloom.core.multimodal.inputs import MultiModalItem


@dataclass(frozen=True)
class ProcessorContext:
    """What a processor is built from."""

    hf_config: Any  # the model's config (transformers attributes)
    model_path: str  # the model's local directory (its processor and image-processor files)
    tokenizer: Any
    processor_kwargs: dict[str, Any]  # --mm-processor-kwargs


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt with every placeholder expanded, and its items in prompt order."""

    prompt_token_ids: list[int]
    items: list[MultiModalItem]


class MultiModalProcessor:
    """Turns a request's images into encoder inputs and the prompt's placeholder tokens.

    A subclass sets :attr:`placeholders` and implements :meth:`process`; it may narrow
    :meth:`max_items_per_prompt` and :meth:`dummy_images`.
    """

    #: modality -> the text the chat template sees for one item (``"<image>"``)
    placeholders: dict[str, str] = {}

    def __init__(self, ctx: ProcessorContext):
        self.ctx = ctx

    def max_items_per_prompt(self) -> dict[str, int | None]:
        """The most items of each modality one prompt may hold (None: no limit of the model's)."""
        return {modality: None for modality in self.placeholders}

    def dummy_images(self) -> list[Any]:
        """The worst-case input for one item: images (PIL) that produce the most feature tokens;
        the server runs them through :meth:`process` at start-up to check the processor works."""
        from PIL import Image

        return [Image.new("RGB", (64, 64))]

    def process(
        self, prompt_token_ids: list[int], images: list[Any], processor_kwargs: dict[str, Any]
    ) -> ProcessedPrompt:
        """Expand each image's placeholder token in ``prompt_token_ids`` (in order: the n-th
        placeholder is the n-th image) and build its item. ``processor_kwargs`` are the
        server's ``--mm-processor-kwargs`` updated with the request's ``mm_processor_kwargs``.
        A mismatch between placeholders and images is an InvalidRequestError."""
        raise NotImplementedError


def image_hash(image: Any, processor_kwargs: dict[str, Any]) -> str:
    """The content hash of a decoded image and the options it is processed with (hex sha256)."""
    digest = hashlib.sha256()
    digest.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    digest.update(repr(sorted(processor_kwargs.items())).encode())
    return digest.hexdigest()
