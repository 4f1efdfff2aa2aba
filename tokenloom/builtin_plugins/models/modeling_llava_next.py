"""LLaVA-NeXT (``LlavaNextForConditionalGeneration``): LLaVA-1.5's CLIP tower, projector and
Llama language model over "anyres" images (registered by
:mod:`~tokenloom.builtin_plugins.models`, with its processor
:mod:`~tokenloom.builtin_plugins.models.llava_next_processing`).

An image arrives as its base image (resized whole to one tile) and the tiles of the
``image_grid_pinpoints`` resolution it fits best; every tile goes through the vision tower and
projector as a LLaVA-1.5 image does. Its embeddings are the base image's features, then the
tiles' features joined into one grid, cut back to the rows or columns the image covers
(:func:`~tokenloom.builtin_plugins.models.llava_next_processing.anyres_layout`), each row
ended by the learned ``image_newline``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenloom.builtin_plugins.models.llava_next_processing import anyres_layout, grid_pinpoints
from tokenloom.builtin_plugins.models.modeling_llava import LlavaForConditionalGeneration
from tokenloom.model_api import ConfigError, ModelContext, MultiModalItem, item_features


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-1.5 with ``image_newline`` and the anyres packing of each image's tiles."""

    def __init__(self, ctx: ModelContext):
        super().__init__(ctx)
        if self.select_strategy != "default":
            # the tiles' class tokens would not fit the patch grid they are joined into
            raise ConfigError(
                f"vision_feature_select_strategy {self.select_strategy!r}: LLaVA-NeXT supports only 'default'"
            )
        vision_config = ctx.hf_config.vision_config
        self.tile_size = vision_config.image_size
        self.patch_size = vision_config.patch_size
        self.pinpoints = grid_pinpoints(ctx.hf_config, self.tile_size)
        self.image_newline = nn.Parameter(torch.empty(self.config.hidden_size, dtype=self.dtype))

    def checkpoint_name(self, name: str) -> str:
        # transformers 4 saved image_newline at the top level, transformers 5 under model.
        if name in ("image_newline", "model.image_newline"):
            return "image_newline"
        return super().checkpoint_name(name)

    def embed_multimodal(self, item: MultiModalItem, attention_backend: Any) -> torch.Tensor:
        """One image's embeddings, ``[item.length, hidden_size]`` (the request's ``image_embeds`` as they are)."""
        return item_features(
            item,
            self.dtype,
            lambda pixels: self.pack_tiles(self.image_features(pixels, attention_backend), item.data["image_size"]),
        )

    def pack_tiles(self, features: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        """The projected features of an image's base and tiles, ``[(1 + tiles) * patches, hidden]``,
        as its embeddings: the base's, then the unpadded grid's rows each ending in ``image_newline``."""
        layout = anyres_layout(image_size, self.pinpoints, self.tile_size, self.patch_size)
        side = layout.patches_per_side
        hidden_size = features.shape[-1]
        base, tiles = features[: layout.base_features], features[layout.base_features :]
        # [tile row, tile column, patch row, patch column] -> [patch row of the grid, patch column of the grid]
        grid = tiles.view(layout.grid_rows, layout.grid_cols, side, side, hidden_size).permute(0, 2, 1, 3, 4)
        grid = grid.reshape(layout.grid_rows * side, layout.grid_cols * side, hidden_size)
        grid = grid[
            layout.row_start : layout.row_start + layout.feature_rows,
            layout.col_start : layout.col_start + layout.feature_cols,
        ]
        newlines = self.image_newline.to(grid.dtype).expand(layout.feature_rows, 1, hidden_size)
        return torch.cat([base, torch.cat([grid, newlines], dim=1).flatten(0, 1)])
