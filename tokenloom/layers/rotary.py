"""Rotary position embeddings (neox / ``rotate_half`` layout, as Hugging Face checkpoints
use): the RoPE parameters read from a config, the inverse frequencies of each scaling
variant (default, linear, dynamic NTK, llama3, yarn, and longrope within its original
context), and :class:`RotaryEmbedding`, which
precomputes its cos/sin table once and rotates queries and keys by position.

Besides the Hugging Face keys, the RoPE parameters may carry ``freq_factors``: one divisor per
rotary frequency, applied after the scaling type's own. It is how llama.cpp stores Llama 3
scaling in a GGUF file (the ``rope_freqs.weight`` tensor, ggml's ``freq_factors``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenloom.errors import ConfigError
from tokenloom.kernels.cpu_native import ops_for

DEFAULT_ROPE_THETA = 10000.0


def rope_parameters_from_config(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE settings of ``config`` as one flat dict with ``rope_type`` and ``rope_theta``.

    Reads transformers 5's ``rope_parameters`` (flat, or nested by ``layer_type`` such as
    ``"sliding_attention"``) and falls back to the older ``rope_scaling`` + ``rope_theta``.
    """
    parameters = getattr(config, "rope_parameters", None)
    if isinstance(parameters, dict) and layer_type is not None and isinstance(parameters.get(layer_type), dict):
        parameters = parameters[layer_type]
    if not parameters:
        parameters = getattr(config, "rope_scaling", None) or {}
    parameters = dict(parameters)
    parameters["rope_type"] = parameters.get("rope_type") or parameters.pop("type", None) or "default"
    # transformers 5 leaves rope_theta None when rope_scaling was assigned after construction
    if parameters.get("rope_theta") is None:
        parameters["rope_theta"] = getattr(config, "rope_theta", None) or DEFAULT_ROPE_THETA
    if parameters.get("partial_rotary_factor") is None:
        parameters["partial_rotary_factor"] = getattr(config, "partial_rotary_factor", None) or 1.0
    return parameters


def _base_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (base**exponents)


def _yarn_inv_freq(parameters: dict, base: float, rotary_dim: int, max_position_embeddings: int):
    original = parameters.get("original_max_position_embeddings") or max_position_embeddings
    factor = parameters.get("factor") or max_position_embeddings / original

    def mscale(scale: float, coefficient: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * coefficient * math.log(scale) + 1.0

    attention_factor = parameters.get("attention_factor")
    if attention_factor is None:
        if parameters.get("mscale") and parameters.get("mscale_all_dim"):
            attention_factor = mscale(factor, parameters["mscale"]) / mscale(factor, parameters["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = parameters.get("beta_fast") or 32
    beta_slow = parameters.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # the dimension whose wavelength makes ``num_rotations`` turns over the original context
        return rotary_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    position_freqs = base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    inv_freq = (1.0 / (factor * position_freqs)) * ramp + (1.0 / position_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor), max(max_position_embeddings, int(original * factor))


def _llama3_inv_freq(parameters: dict, base: float, rotary_dim: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(base, rotary_dim)
    factor = parameters["factor"]
    low_freq_factor, high_freq_factor = parameters["low_freq_factor"], parameters["high_freq_factor"]
    old_context_len = parameters["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are interpolated by `factor`, short ones kept, the band between blended
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(
    parameters: dict[str, Any], rotary_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float, int]:
    """``(inv_freq [rotary_dim / 2], attention_scaling, positions the table must cover)``."""
    inv_freq, attention_scaling, table_len = _scaled_inv_freq(parameters, rotary_dim, max_position_embeddings)
    freq_factors = parameters.get("freq_factors")
    if freq_factors is None:
        return inv_freq, attention_scaling, table_len
    factors = torch.tensor(freq_factors, dtype=torch.float32)
    if factors.shape != inv_freq.shape or not bool((factors > 0).all()):
        raise ConfigError(
            f"RoPE freq_factors must be {inv_freq.numel()} positive numbers, one per rotary frequency "
            f"(rotary dimension {rotary_dim}); got {factors.numel()}",
            param="rope_scaling",
        )
    # ggml divides each frequency by its factor (ggml_rope_ext's freq_factors)
    return inv_freq / factors, attention_scaling, table_len


def _scaled_inv_freq(
    parameters: dict[str, Any], rotary_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float, int]:
    rope_type = parameters.get("rope_type", "default")
    base = float(parameters.get("rope_theta") or DEFAULT_ROPE_THETA)
    if rope_type == "default":
        return _base_inv_freq(base, rotary_dim), 1.0, max_position_embeddings
    if rope_type == "linear":
        factor = parameters["factor"]
        return _base_inv_freq(base, rotary_dim) / factor, 1.0, int(max_position_embeddings * factor)
    if rope_type == "dynamic":
        # transformers rescales the base per forward from the batch's longest sequence; a
        # serving batch mixes lengths, so the table is fixed at the longest supported one
        factor = parameters["factor"]
        scaled_len = max_position_embeddings * factor
        base *= ((factor * scaled_len / max_position_embeddings) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
        return _base_inv_freq(base, rotary_dim), 1.0, int(scaled_len)
    if rope_type == "llama3":
        return _llama3_inv_freq(parameters, base, rotary_dim), 1.0, max_position_embeddings
    if rope_type == "yarn":
        return _yarn_inv_freq(parameters, base, rotary_dim, max_position_embeddings)
    if rope_type == "longrope":
        return _longrope_short_inv_freq(parameters, base, rotary_dim, max_position_embeddings)
    raise ConfigError(
        f"unsupported RoPE type {rope_type!r}; supported: default, linear, dynamic, llama3, yarn, "
        "longrope (within its original context)",
        param="rope_scaling",
    )


def longrope_original_length(parameters: dict[str, Any]) -> int:
    original = parameters.get("original_max_position_embeddings")
    if not original:
        raise ConfigError("longrope RoPE scaling needs original_max_position_embeddings", param="rope_scaling")
    return int(original)


def _longrope_short_inv_freq(
    parameters: dict[str, Any], base: float, rotary_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float, int]:
    """LongRoPE (Phi-3) as transformers computes it for a sequence within the original context:
    each frequency divided by its ``short_factor``, cos/sin scaled by the attention factor (from
    the ratio of the extended to the original context). The table covers the original context
    only: past it transformers switches to ``long_factor`` for the whole sequence, recomputing
    keys already cached, which a paged cache cannot do (:func:`get_rope` refuses a longer one)."""
    original = longrope_original_length(parameters)
    short_factor = parameters.get("short_factor")
    if not isinstance(short_factor, list | tuple) or len(short_factor) != rotary_dim // 2:
        raise ConfigError(
            f"longrope short_factor must be {rotary_dim // 2} numbers, one per rotary frequency",
            param="rope_scaling",
        )
    factor = parameters.get("factor") or max_position_embeddings / original
    attention_factor = parameters.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (torch.tensor(short_factor, dtype=torch.float32) * base**exponents)
    return inv_freq, float(attention_factor), original


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` features of each head by position (``rotate_half``
    layout); the rest pass through. The cos/sin table covers ``max_position`` positions."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        inv_freq: torch.Tensor,
        max_position: int,
        *,
        attention_scaling: float = 1.0,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_size:
            raise ConfigError(f"rotary dimension {rotary_dim} must be even and at most the head size {head_size}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())
        dtype = dtype or torch.get_default_dtype()
        self.register_buffer("cos_cache", (freqs.cos() * attention_scaling).to(dtype), persistent=False)
        self.register_buffer("sin_cache", (freqs.sin() * attention_scaling).to(dtype), persistent=False)
        self._table_positions: torch.Tensor | None = None
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def _step_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos [T, 1, rotary_dim]`` and signed ``sin`` for ``positions``, looked up once per
        step: every layer of a step passes the same ``positions`` tensor."""
        if positions is not self._table_positions:
            cos, sin = self.cos_cache[positions], self.sin_cache[positions]
            self._tables = (torch.cat([cos, cos], dim=-1).unsqueeze(1), torch.cat([-sin, sin], dim=-1).unsqueeze(1))
            self._table_positions = positions
        return self._tables

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H * D]`` (or ``[T, H, D]``, any row stride) rotated to ``positions [T]``, as a
        ``[T, H, D]`` tensor: on the CPU ``x`` itself, rotated in place by one fused operator;
        elsewhere a new tensor. Queries and keys stored side by side rotate in one call."""
        num_tokens = x.shape[0]
        heads = x.view(num_tokens, -1, self.head_size)
        ops = ops_for(x) if x.dtype == self.cos_cache.dtype and positions.dtype == torch.long else None
        if ops is not None:
            ops.rotary_embedding_(heads, positions, self.cos_cache, self.sin_cache)
            return heads
        cos, sin = self._step_tables(positions)
        half = self.rotary_dim // 2
        rotary = heads[..., : self.rotary_dim]
        # rotate_half(x) * sin == swapped halves * [-sin, sin]
        swapped = rotary.unflatten(-1, (2, half)).flip(-2).flatten(-2)
        rotated = rotary * cos + swapped * sin
        if self.rotary_dim < self.head_size:
            rotated = torch.cat([rotated, heads[..., self.rotary_dim :]], dim=-1)
        return rotated

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``query [T, Hq * D]`` (or ``[T, Hq, D]``) and ``key`` rotated to ``positions [T]``,
        in their input shapes."""
        return self.rotate(positions, query).view(query.shape), self.rotate(positions, key).view(key.shape)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_position={self.max_position}"


def get_rope(
    head_size: int,
    rope_parameters: dict[str, Any],
    max_position_embeddings: int,
    *,
    max_position: int | None = None,
    dtype: torch.dtype | None = None,
) -> RotaryEmbedding:
    """A :class:`RotaryEmbedding` for ``rope_parameters`` (see :func:`rope_parameters_from_config`);
    the table covers the scaled context, or ``max_position`` if that is longer."""
    rotary_dim = int(head_size * float(rope_parameters.get("partial_rotary_factor") or 1.0))
    if rope_parameters.get("rope_type") == "longrope":
        original = longrope_original_length(rope_parameters)
        context = max_position or max_position_embeddings
        if context > original:
            raise ConfigError(
                f"longrope RoPE scaling is exact only within the original context of {original} tokens (its short "
                f"factors); past it transformers switches every position of the sequence to the long factors, "
                f"recomputing the keys it cached, which tokenloom's paged KV cache cannot do. The context asked "
                f"for is {context} tokens: pass --max-model-len {original} (or less)",
                param="max-model-len",
            )
    inv_freq, attention_scaling, table_len = compute_inv_freq(rope_parameters, rotary_dim, max_position_embeddings)
    return RotaryEmbedding(
        head_size,
        rotary_dim,
        inv_freq,
        max(table_len, max_position or 0),
        attention_scaling=attention_scaling,
        dtype=dtype,
    )
