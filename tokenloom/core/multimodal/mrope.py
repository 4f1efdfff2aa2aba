"""M-RoPE positions (Qwen2-VL's multimodal rotary embedding): each token's (temporal, height,
width) position in a prompt whose items carry an :data:`MROPE_GRID`, and the step's positions
the model runner hands a model built for them (:func:`step_positions`).

An item's tokens sit on its grid: ``t``, ``h`` and ``w`` each start at the position the item's
first token would have had, plus the token's row and column. The text after it resumes at that
start plus ``max(h, w)``, so every token after an item (the rest of the prompt, then every
generated token) is at its index plus a shift, ``max(h, w) - length`` per item before it:
vLLM's ``mrope_position_delta`` (transformers' ``rope_deltas``), recomputed here from the items
rather than stored per request. A text token's three positions are equal, which is plain RoPE.
No torch at import: a processor in the server imports :data:`MROPE_GRID` from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tokenloom.core.multimodal.inputs import MultiModalItem

if TYPE_CHECKING:
    import torch

#: ``item.data`` key of an item placed on an M-RoPE grid: ``(t, h, w)``, its tokens' temporal,
#: height and width extent in the language model's grid (after any patch merging), ``t * h * w
#: == item.length``, tokens in ``t``, then ``h``, then ``w`` order
MROPE_GRID = "mrope_grid"


def mrope_positions(items: Sequence[MultiModalItem], first: int, num_tokens: int) -> torch.Tensor:
    """``[3, num_tokens]`` positions of a sequence's tokens ``first, first + 1, ...``, given its
    prompt's items (those without an :data:`MROPE_GRID` count as text)."""
    import torch

    index = torch.arange(first, first + num_tokens)
    positions = index.expand(3, -1).clone()
    shift = 0  # what the items so far moved the positions after them
    for item in items:
        grid = item.data.get(MROPE_GRID)
        if grid is None:
            continue
        _, height, width = grid
        start = item.offset + shift
        low, high = max(item.offset, first), min(item.end, first + num_tokens)
        if low < high:
            within = torch.arange(low - item.offset, high - item.offset)
            plane = height * width
            positions[:, low - first : high - first] = start + torch.stack(
                [within // plane, within % plane // width, within % width]
            )
        advance = max(height, width) - item.length
        positions[:, index >= item.end] += advance
        shift += advance
    return positions


def uses_mrope(items: Sequence[MultiModalItem]) -> bool:
    return any(MROPE_GRID in item.data for item in items)


def step_positions(rows: Sequence[tuple[Sequence[Any], int, int]], positions: torch.Tensor) -> torch.Tensor:
    """The positions a step's model call takes. ``rows`` are the step's ``(items, first_position,
    num_tokens)`` in batch order (as :func:`~tokenloom.core.multimodal.encoder_cache.merged_input_embeddings`
    takes them) and ``positions`` its flat ``[T]`` positions: returned as they are when no row's
    items are on an M-RoPE grid; else ``[3, T]`` M-RoPE positions, or ``[T]`` when the three
    agree for every token (no item token in the step), which plain RoPE and the fused decode
    layer take."""
    if not any(uses_mrope(items) for items, _, _ in rows):
        return positions
    import torch

    pieces = [
        mrope_positions(items, first, num_tokens)
        if uses_mrope(items)
        else torch.arange(first, first + num_tokens).expand(3, -1)
        for items, first, num_tokens in rows
    ]
    step = torch.cat(pieces, dim=1)
    if bool((step[0] == step[1]).all()) and bool((step[0] == step[2]).all()):
        step = step[0]
    return step.to(positions.device)
