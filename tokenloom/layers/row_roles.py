"""Which rows of the forward pass in progress compute prompt tokens, for layers whose kernels
multiply prompt rows another way than the rest.

A GGUF 4- or 6-bit layer multiplies a decode step's few rows in 8-bit activations and integer dot
products, the arithmetic llama.cpp uses, which reads each weight byte once. A prompt's hundreds
of rows are bound by compute instead, and on a CPU with AMX-BF16 they run faster with the weight
decoded once per call to bfloat16 and multiplied in AMX tiles (kernels/int4_matmul.py,
kernels/kquant_matmul.py). Which arithmetic a row gets follows from its position alone, inside
its sequence's prompt or not, never from the batch it shares: a row gets the same bits whether it
runs alone, beside other requests' prompts or beside decodes, and a preempted request's
recomputed tokens get the bits they first had.

The decoder skeleton (models/causal_lm.py) enters :func:`computing` around its layers with the
step's :class:`~tokenloom.core.batch.AttentionMetadata` lists; a layer's method calls
:func:`split_by_role`. Outside it (a draft model's step, an encoder, a profile run) every row takes
the decode arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptRows:
    """The prompt rows of a batch of ``num_rows`` token rows: all of them (``prompt_index`` None),
    or those of ``prompt_index`` beside the others of ``other_index`` (both in row order)."""

    num_rows: int
    prompt_index: torch.Tensor | None = None
    other_index: torch.Tensor | None = None


_CURRENT: ContextVar[PromptRows | None] = ContextVar("tokenloom_prompt_rows", default=None)


def prompt_rows(query_lens: Sequence[int], prompt_query_lens: Sequence[int] | None) -> PromptRows | None:
    """The :class:`PromptRows` of a batch whose sequence ``i`` has ``query_lens[i]`` rows, of
    which the first ``prompt_query_lens[i]`` compute prompt tokens; None when no row does (or the
    runner did not say)."""
    if prompt_query_lens is None:
        return None
    num_rows = sum(query_lens)
    num_prompt = sum(prompt_query_lens)
    if num_prompt == 0:
        return None
    if num_prompt == num_rows:
        return PromptRows(num_rows)
    is_prompt: list[bool] = []
    for count, prompt in zip(query_lens, prompt_query_lens, strict=True):
        is_prompt += [True] * prompt + [False] * (count - prompt)
    mask = torch.tensor(is_prompt)
    return PromptRows(num_rows, mask.nonzero().flatten(), (~mask).nonzero().flatten())


@contextmanager
def computing(query_lens: Sequence[int], prompt_query_lens: Sequence[int] | None) -> Iterator[None]:
    """The layers called inside see this batch's prompt rows (see :func:`prompt_rows`)."""
    token = _CURRENT.set(prompt_rows(query_lens, prompt_query_lens))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def split_by_role(
    x: torch.Tensor,
    other_fn: Callable[[torch.Tensor], torch.Tensor],
    prompt_fn: Callable[[torch.Tensor], torch.Tensor] | None,
) -> torch.Tensor:
    """``x [rows, K]`` through ``other_fn`` and its prompt rows through ``prompt_fn``, each
    result in its row's place. Every row takes ``other_fn`` when ``prompt_fn`` is None, no
    batch is being computed, or ``x`` is not the batch's rows (an LM head's selected rows, a
    mixture of experts' routed ones)."""
    current = _CURRENT.get()
    if prompt_fn is None or current is None or x.dim() != 2 or x.shape[0] != current.num_rows:
        return other_fn(x)
    if current.prompt_index is None or current.other_index is None:
        return prompt_fn(x)
    prompt_out = prompt_fn(x.index_select(0, current.prompt_index))
    other_out = other_fn(x.index_select(0, current.other_index))
    out = prompt_out.new_empty((x.shape[0], prompt_out.shape[1]))
    out.index_copy_(0, current.prompt_index, prompt_out)
    out.index_copy_(0, current.other_index, other_out.to(prompt_out.dtype))
    return out
