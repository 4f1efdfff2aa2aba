"""Guided decoding's plugin interface: a :class:`StructuredOutputBackend` compiles a
:class:`~tokenloom.core.structured_output_constraints.Constraint` and gives each sequence a
:class:`Matcher`; and the allowed-token bitmask they fill. The engine's side is
:mod:`~tokenloom.core.structured_output`.

Bitmasks are int32 tensors of shape ``[rows, ceil(vocab_size / 32)]``; bit ``t % 32`` of word
``t // 32`` set means token ``t`` is allowed (xgrammar's layout).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tokenloom.core.structured_output_constraints import BackendOptions, Constraint

if TYPE_CHECKING:
    import torch


def num_bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    import torch

    return torch.zeros((num_rows, num_bitmask_words(vocab_size)), dtype=torch.int32)


def set_allowed_tokens(bitmask_row: torch.Tensor, token_ids: Iterable[int]) -> None:
    """Overwrite one bitmask row (a 1-D int32 tensor) so exactly ``token_ids`` are allowed."""
    import numpy as np
    import torch

    num_words = bitmask_row.shape[0]
    ids = np.fromiter(token_ids, dtype=np.int64)
    ids = ids[(ids >= 0) & (ids < num_words * 32)]
    words = np.zeros(num_words, dtype=np.uint32)
    np.bitwise_or.at(words, ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
    bitmask_row.copy_(torch.from_numpy(words.view(np.int32)))


class Matcher:
    """The grammar state of one sequence; used from the engine thread only.

    Implement :meth:`fill_bitmask` (fast) or :meth:`allowed_token_ids` (simple). When the
    constraint is complete the allowed tokens must include the end-of-sequence tokens the
    backend was given.
    """

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (overwrite the whole row)."""
        set_allowed_tokens(bitmask[row], self.allowed_token_ids())

    def allowed_token_ids(self) -> list[int]:
        """Tokens allowed at the next position (used by the default :meth:`fill_bitmask`)."""
        raise NotImplementedError

    def accept_token(self, token_id: int) -> bool:
        """Advance by a sampled token; False (state unchanged) when the token is not allowed."""
        raise NotImplementedError

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens. The default raises
        NotImplementedError and the engine resets and replays instead."""
        raise NotImplementedError

    def is_terminated(self) -> bool:
        """True once an end-of-sequence token was accepted: nothing may follow."""
        raise NotImplementedError

    def reset(self) -> None:
        """Back to the start (the engine then replays the sequence's constrained tokens)."""
        raise NotImplementedError


class StructuredOutputBackend:
    """Registered with ``register_structured_output_backends``; one instance per engine, in
    the main process, constructed as ``Backend(tokenizer, vocab_size, eos_token_ids, options)``.

    Construction must be cheap: do heavy set-up (vocabulary tables) on the first ``compile``.
    ``supports`` and ``compile`` run in the compile pool's threads, each call bounded by
    ``--structured-outputs-compile-timeout``, and ``compile`` may run in several at once. A
    compile that can be stopped part-way (work in a child process, say) polls
    :func:`~tokenloom.core.structured_output_compile.compile_cancelled` and gives up once it is
    true.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], options: BackendOptions):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.options = options

    def supports(self, constraint: Constraint) -> str | None:
        """None when this backend can express ``constraint``, else why not (shown to the user)."""
        raise NotImplementedError

    def compile(self, constraint: Constraint) -> Any:
        """Compile into an immutable object shared by every sequence with this constraint (and
        cached); raise InvalidRequestError naming what is wrong with an invalid constraint."""
        raise NotImplementedError

    def new_matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the start of ``compiled`` (one per sequence)."""
        raise NotImplementedError
