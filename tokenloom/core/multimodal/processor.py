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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenloom.core.multimodal.inputs import MultiModalItem
from tokenloom.errors import InvalidRequestError


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
    #: whether :meth:`process` takes :class:`ImageEmbeddings` in place of images
    takes_image_embeds: bool = False

    def __init__(self, ctx: ProcessorContext):
        self.ctx = ctx

    def max_items_per_prompt(self) -> dict[str, int | None]:
        """The most items of each modality one prompt may hold (None: no limit of the model's)."""
        return {modality: None for modality in self.placeholders}

    def dummy_images(self) -> list[Any]:
        """The worst-case input for one item: images (PIL) that produce the most feature tokens
        (:func:`worst_case_items`): the server runs them through :meth:`process` at start-up to
        check the processor works, and a platform that profiles activations encodes them in its
        profile run."""
        from PIL import Image

        return [Image.new("RGB", (64, 64))]

    def process(
        self, prompt_token_ids: list[int], images: list[Any], processor_kwargs: dict[str, Any]
    ) -> ProcessedPrompt:
        """Expand each image's placeholder token in ``prompt_token_ids`` (in order: the n-th
        placeholder is the n-th image) and build its item. An image is a decoded PIL image, or
        :class:`ImageEmbeddings` when :attr:`takes_image_embeds`. ``processor_kwargs`` are the
        server's ``--mm-processor-kwargs`` updated with the request's ``mm_processor_kwargs``.
        A mismatch between placeholders and images is an InvalidRequestError
        (:func:`splice_placeholders` does both)."""
        raise NotImplementedError


@dataclass(frozen=True)
class PlaceholderExpansion:
    """What one image's placeholder token becomes: ``token_ids`` spliced in its place, and the
    item over ``item_length`` of them from ``item_start`` (None: through the last)."""

    token_ids: list[int]
    hash: str
    data: dict[str, Any] = field(default_factory=dict)
    item_start: int = 0
    item_length: int | None = None
    # the item's tokens attend to each other both ways in prefill (MultiModalItem.bidirectional)
    bidirectional: bool = False


def splice_placeholders(
    prompt_token_ids: list[int],
    placeholder_token_id: int,
    images: list[Any],
    expand: Callable[[Any], PlaceholderExpansion],
    placeholder_text: str,
) -> ProcessedPrompt:
    """``prompt_token_ids`` with its n-th ``placeholder_token_id`` replaced by ``expand`` of the
    n-th image, and the images' items at their places. A prompt whose placeholder count is not
    the image count is an InvalidRequestError naming ``placeholder_text`` (what the chat template
    renders for an image)."""
    placeholders = [index for index, token in enumerate(prompt_token_ids) if token == placeholder_token_id]
    if len(placeholders) != len(images):
        raise InvalidRequestError(
            f"the prompt holds {len(placeholders)} image placeholder(s) ({placeholder_text}) but "
            f"{len(images)} image(s) came with it: the chat template must place one per image",
            param="messages",
        )
    token_ids: list[int] = []
    items: list[MultiModalItem] = []
    previous = 0
    for placeholder, image in zip(placeholders, images, strict=True):
        expansion = expand(image)
        token_ids += prompt_token_ids[previous:placeholder]
        item_length = expansion.item_length
        if item_length is None:
            item_length = len(expansion.token_ids) - expansion.item_start
        items.append(
            MultiModalItem(
                "image",
                expansion.hash,
                offset=len(token_ids) + expansion.item_start,
                length=item_length,
                data=expansion.data,
                bidirectional=expansion.bidirectional,
            )
        )
        token_ids += expansion.token_ids
        previous = placeholder + 1
    token_ids += prompt_token_ids[previous:]
    return ProcessedPrompt(token_ids, items)


def worst_case_items(processor: MultiModalProcessor) -> list[MultiModalItem]:
    """The items of :meth:`MultiModalProcessor.dummy_images`, each behind its placeholder, processed
    with the server's ``--mm-processor-kwargs``: the start-up check of a processor, and the media
    a platform that profiles activations encodes in its profile run."""
    images = processor.dummy_images()
    placeholder = processor.placeholders["image"]
    prompt_ids = list(processor.ctx.tokenizer.encode(placeholder * len(images), add_special_tokens=False))
    return processor.process(prompt_ids, images, processor.ctx.processor_kwargs).items


@dataclass(frozen=True)
class ImageEmbeddings:
    """An image given as its embeddings (an ``image_embeds`` content part, ``--enable-mm-embeds``):
    the rows that replace its feature tokens, so the vision encoder never runs. ``where``
    names the part for errors."""

    tensor: Any  # a torch tensor, [feature tokens, hidden size] as the request sent it
    where: str

    def checked(self, num_rows: int, hidden_size: int) -> Any:
        """The embeddings as a float tensor ``[num_rows, hidden_size]`` (a leading batch of one
        dropped); an InvalidRequestError naming the part when they are not."""
        import torch

        tensor = self.tensor
        if tensor.dim() == 3 and tensor.shape[0] == 1:
            tensor = tensor[0]
        if not tensor.is_floating_point():
            raise InvalidRequestError(
                f"{self.where}: image_embeds must be a floating-point tensor, not {tensor.dtype}", param=self.where
            )
        if tuple(tensor.shape) != (num_rows, hidden_size):
            raise InvalidRequestError(
                f"{self.where}: image_embeds of shape {tuple(self.tensor.shape)}; this model takes one image's "
                f"embeddings as ({num_rows}, {hidden_size}) (feature tokens, hidden size)",
                param=self.where,
            )
        return tensor.to(torch.float32).contiguous()

    def hash(self) -> str:
        """The content hash of the embeddings (hex sha256), as :func:`image_hash` of an image."""
        import torch

        tensor = self.tensor.contiguous()
        digest = hashlib.sha256(f"embeds:{tensor.dtype}:{tuple(tensor.shape)}:".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()


def image_hash(image: Any, processor_kwargs: dict[str, Any]) -> str:
    """The content hash of a decoded image and the options it is processed with (hex sha256)."""
    digest = hashlib.sha256()
    digest.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    digest.update(repr(sorted(processor_kwargs.items())).encode())
    return digest.hexdigest()
