"""Multimodal rotary embedding (M-RoPE, Qwen2-VL's): the rotary frequencies split into three
sections, rotated by a token's temporal, height and width positions
(:mod:`tokenloom.core.multimodal.mrope` computes them)."""

from __future__ import annotations

from typing import Any

import torch

from tokenloom.errors import ConfigError
from tokenloom.layers.rotary import RotaryEmbedding, compute_inv_freq


class MRotaryEmbedding(RotaryEmbedding):
    """Takes ``[3, T]`` positions: frequency ``i`` turns by the position of the section it falls
    in (``mrope_section`` frequencies each for t, h, w). ``[T]`` positions (every text-only step)
    mean three equal positions, which is plain RoPE and takes its fused CPU path."""

    def __init__(self, head_size: int, inv_freq: torch.Tensor, max_position: int, mrope_section: list[int], **kwargs):
        super().__init__(head_size, head_size, inv_freq, max_position, **kwargs)
        if len(mrope_section) != 3 or sum(mrope_section) != head_size // 2:
            raise ConfigError(
                f"mrope_section {mrope_section} must be three numbers of frequencies adding up to half the head "
                f"size ({head_size // 2})",
                param="rope_scaling",
            )
        # the position row (0: t, 1: h, 2: w) of each rotary frequency
        section_rows = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
        self.register_buffer("section_rows", section_rows, persistent=False)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if positions.dim() == 1:
            return super().rotate(positions, x)
        frequencies = torch.arange(self.rotary_dim // 2, device=positions.device)
        token_positions = positions[self.section_rows].transpose(0, 1)  # [T, rotary_dim / 2]
        cos = self.cos_cache[token_positions, frequencies]
        sin = self.sin_cache[token_positions, frequencies]
        heads = x.view(x.shape[0], -1, self.head_size)
        cos, sin = torch.cat([cos, cos], dim=-1).unsqueeze(1), torch.cat([-sin, sin], dim=-1).unsqueeze(1)
        half = self.rotary_dim // 2
        swapped = heads.unflatten(-1, (2, half)).flip(-2).flatten(-2)
        return (heads * cos + swapped * sin).to(x.dtype)


def get_mrope(
    head_size: int, rope_parameters: dict[str, Any], max_position: int, *, dtype: torch.dtype | None = None
) -> MRotaryEmbedding:
    """The M-RoPE of a config's RoPE parameters (``mrope_section``, ``rope_theta``; the ``mrope``
    type older configs name is the default frequencies)."""
    parameters = dict(rope_parameters)
    if parameters.get("rope_type") == "mrope":
        parameters["rope_type"] = "default"
    section = parameters.get("mrope_section")
    if section is None:
        raise ConfigError("an M-RoPE model's rope_scaling needs mrope_section", param="rope_scaling")
    inv_freq, attention_scaling, table_len = compute_inv_freq(parameters, head_size, max_position)
    return MRotaryEmbedding(
        head_size,
        inv_freq,
        max(table_len, max_position),
        list(section),
        attention_scaling=attention_scaling,
        dtype=dtype,
    )
