"""One media item of a prompt as the engine carries it (:class:`MultiModalItem`): its
modality, its content hash, where its placeholder tokens sit in the prompt and the encoder
inputs the model embeds it from; and :func:`block_extra_keys`, which ties prefix-cache blocks
to the items whose placeholders they hold."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MultiModalItem:
    """One image (or other medium) of a prompt, after its processor.

    The prompt holds ``length`` placeholder tokens for it from ``offset`` on; the model turns
    ``data`` (CPU tensors, e.g. ``pixel_values``) into exactly ``length`` embeddings that
    replace those tokens' embeddings. ``hash`` identifies the content and the processor
    options: the encoder cache and the prefix cache key by it.
    """

    modality: str
    hash: str
    offset: int
    length: int
    data: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # the item's tokens attend to each other both ways during prefill (Gemma 3's images), so a
    # prefill chunk never ends inside it (core/step_budget.py:keep_items_whole)
    bidirectional: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.length


def block_extra_keys(items: Sequence[MultiModalItem], start: int, end: int) -> tuple[int, ...]:
    """What a prefix-cache block over prompt positions ``[start, end)`` adds to its token ids:
    for each item whose placeholders it overlaps, a marker, the item's position and the first
    eight bytes of its hash. Two prompts with the same tokens and different images then
    never share a block from the first placeholder on."""
    keys: list[int] = []
    for item in items:
        if item.offset < end and item.end > start:
            keys += (-1, item.offset, int.from_bytes(bytes.fromhex(item.hash[:16]), "big", signed=True))
    return tuple(keys)


def check_items(items: Sequence[MultiModalItem], num_prompt_tokens: int) -> None:
    """Raise InvalidRequestError unless ``items`` are MultiModalItems whose placeholder ranges
    lie in the prompt, in order, without overlapping."""
    from tokenloom.errors import InvalidRequestError

    previous_end = 0
    for index, item in enumerate(items):
        if not isinstance(item, MultiModalItem):
            raise InvalidRequestError(f"mm_items[{index}] is not a MultiModalItem", param="prompt")
        if item.length < 1 or item.offset < previous_end or item.end > num_prompt_tokens:
            raise InvalidRequestError(
                f"mm_items[{index}]: its placeholders [{item.offset}, {item.end}) are not inside the "
                f"{num_prompt_tokens}-token prompt after the previous item's",
                param="prompt",
            )
        previous_end = item.end


def item_features(item: MultiModalItem, dtype: Any, encode: Callable[[Any], Any]) -> Any:
    """An image item's features: the request's ``image_embeds`` as they are, else ``encode`` of
    its ``pixel_values`` in ``dtype`` (with a leading batch dimension: ``[frames, 3, H, W]``)."""
    if "image_embeds" in item.data:
        return item.data["image_embeds"].to(dtype)
    pixel_values = item.data["pixel_values"].to(dtype)
    if pixel_values.dim() == 3:
        pixel_values = pixel_values.unsqueeze(0)
    return encode(pixel_values)
