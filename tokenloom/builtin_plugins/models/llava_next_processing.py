"""LLaVA-NeXT's anyres layout (:func:`anyres_layout`: which grid of tiles an image is cut into
and which of its feature rows and columns survive the unpadding) and its multimodal processor,
which counts an image's feature tokens with it; the model packs its features with the same
layout, so the two always agree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenloom.builtin_plugins.models.llava_processing import LlavaProcessor
from tokenloom.plugin_api import (
    ImageEmbeddings,
    InvalidRequestError,
    ModelLoadError,
    ProcessorContext,
    image_hash,
)


def best_resolution(image_size: tuple[int, int], pinpoints: list[tuple[int, int]]) -> tuple[int, int]:
    """The ``(height, width)`` of ``pinpoints`` an image of ``image_size`` (height, width) is resized
    into: the one keeping most of its pixels, then the one wasting fewest, the first on a tie."""
    height, width = image_size
    best, best_kept, best_wasted = pinpoints[0], -1, 0
    for pin_height, pin_width in pinpoints:
        scale = min(pin_width / width, pin_height / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = pin_width * pin_height - kept
        if kept > best_kept or (kept == best_kept and wasted < best_wasted):
            best, best_kept, best_wasted = (pin_height, pin_width), kept, wasted
    return best


@dataclass(frozen=True)
class AnyresLayout:
    """How one image's features are laid out: the base image's ``base_features``, then the tiles'
    patch grid (``grid_rows`` x ``grid_cols`` tiles of ``patches_per_side``\\ :sup:`2` patches)
    cut to the rows ``[row_start, row_start + feature_rows)`` and the columns ``[col_start,
    col_start + feature_cols)`` the image covers, each row followed by one ``image_newline``."""

    grid_rows: int
    grid_cols: int
    patches_per_side: int
    row_start: int
    feature_rows: int
    col_start: int
    feature_cols: int

    @property
    def num_tiles(self) -> int:
        return self.grid_rows * self.grid_cols

    @property
    def base_features(self) -> int:
        return self.patches_per_side**2

    @property
    def num_features(self) -> int:
        return self.base_features + self.feature_rows * (self.feature_cols + 1)


def anyres_layout(
    image_size: tuple[int, int], pinpoints: list[tuple[int, int]], tile_size: int, patch_size: int
) -> AnyresLayout:
    """The layout of an image of ``image_size`` (height, width) for a vision tower over
    ``tile_size`` pixel tiles in ``patch_size`` pixel patches."""
    height, width = image_size
    best_height, best_width = best_resolution(image_size, pinpoints)
    patches_per_side = tile_size // patch_size
    grid_rows, grid_cols = best_height // tile_size, best_width // tile_size
    rows, cols = grid_rows * patches_per_side, grid_cols * patches_per_side
    # the image was resized to fit the grid and padded evenly along one side: drop the padding's
    # rows (a wider image than the grid) or columns (a taller one)
    row_start = col_start = 0
    feature_rows, feature_cols = rows, cols
    if width * rows > cols * height:
        padding = (rows - height * cols // width) // 2
        row_start, feature_rows = padding, rows - 2 * padding
    else:
        padding = (cols - width * rows // height) // 2
        col_start, feature_cols = padding, cols - 2 * padding
    return AnyresLayout(grid_rows, grid_cols, patches_per_side, row_start, feature_rows, col_start, feature_cols)


def grid_pinpoints(config: Any, tile_size: int) -> list[tuple[int, int]]:
    """The config's ``image_grid_pinpoints`` as ``(height, width)`` pairs; a ModelLoadError unless
    each is a whole number of tiles."""
    configured = getattr(config, "image_grid_pinpoints", None)
    try:
        pinpoints = [(int(height), int(width)) for height, width in configured]
    except (TypeError, ValueError):
        pinpoints = []
    if not pinpoints or any(
        min(height, width) <= 0 or height % tile_size or width % tile_size for height, width in pinpoints
    ):
        raise ModelLoadError(
            f"image_grid_pinpoints {configured!r}: LLaVA-NeXT needs a list of (height, width) resolutions, "
            f"each a positive multiple of the vision tower's {tile_size}-pixel image_size"
        )
    return pinpoints


class LlavaNextProcessor(LlavaProcessor):
    """Each image through the checkpoint's LLaVA-NeXT image processor (the base image and its
    tiles), and its ``<image>`` token expanded to :func:`anyres_layout`'s feature count.
    ``image_embeds`` stand for the packed features (their row count is the image's)."""

    def __init__(self, ctx: ProcessorContext):
        super().__init__(ctx)
        vision_config = ctx.hf_config.vision_config
        self.tile_size = vision_config.image_size
        self.pinpoints = grid_pinpoints(ctx.hf_config, self.tile_size)
        processor_pinpoints = getattr(self.image_processor, "image_grid_pinpoints", None)
        if processor_pinpoints is None or [tuple(pin) for pin in processor_pinpoints] != self.pinpoints:
            raise ModelLoadError(
                f"{ctx.model_path}: the image processor's image_grid_pinpoints {processor_pinpoints!r} are not "
                f"the model's {ctx.hf_config.image_grid_pinpoints!r}"
            )

    def dummy_images(self) -> list[Any]:
        from PIL import Image

        def features(pinpoint: tuple[int, int]) -> int:
            return anyres_layout(pinpoint, self.pinpoints, self.tile_size, self.patch_size).num_features

        # an image of a pinpoint's exact shape fills its whole grid: nothing is unpadded
        height, width = max(self.pinpoints, key=features)
        return [Image.new("RGB", (width, height))]

    def image_inputs(self, image: Any, processor_kwargs: dict[str, Any]) -> tuple[str, int, dict[str, Any]]:
        """An image's (or its embeddings') hash, feature tokens and item data (the tiles'
        ``pixel_values``, the base image first, and the ``image_size`` they were cut from)."""
        if isinstance(image, ImageEmbeddings):
            num_rows = image.tensor.shape[-2] if image.tensor.dim() >= 2 else 0
            embeds = image.checked(num_rows, self.ctx.hf_config.text_config.hidden_size)
            return image.hash(), num_rows, {"image_embeds": embeds}
        try:
            processed = self.image_processor(images=[image], return_tensors="pt", **processor_kwargs)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(
                f"mm_processor_kwargs {processor_kwargs!r} do not suit the image processor: {exc}",
                param="mm_processor_kwargs",
            ) from None
        pixel_values = processed["pixel_values"][0]
        height, width = (int(side) for side in processed["image_sizes"][0])
        layout = anyres_layout((height, width), self.pinpoints, self.tile_size, self.patch_size)
        if tuple(pixel_values.shape[-2:]) != (self.tile_size, self.tile_size) or (
            pixel_values.shape[0] != layout.num_tiles + 1
        ):
            raise InvalidRequestError(
                f"mm_processor_kwargs {processor_kwargs!r} cut the image into {pixel_values.shape[0]} tiles of "
                f"{tuple(pixel_values.shape[-2:])} pixels; this model takes the base image and {layout.num_tiles} "
                f"tiles of ({self.tile_size}, {self.tile_size}) from its image_grid_pinpoints",
                param="mm_processor_kwargs",
            )
        data = {"pixel_values": pixel_values, "image_size": (height, width)}
        return image_hash(image, processor_kwargs), layout.num_features, data
