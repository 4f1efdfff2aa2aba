"""The guided-decoding interface: a :class:`StructuredOutputBackend` compiles a request's
constraint into a :class:`Matcher`; each step the engine asks every constrained request's
matcher for its allowed tokens, and advances it by the sampled token. Backends are plugins."""

from __future__ import annotations

from typing import Any


class Matcher:
    """The state of one constrained sequence."""

    def allowed_token_ids(self) -> list[int]:
        """Tokens allowed at the next position."""
        raise NotImplementedError

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False when the token is not allowed."""
        raise NotImplementedError

    def is_terminated(self) -> bool:
        """True when the constraint is complete (only EOS may follow)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Back to the start (a preempted request replays its tokens through ``accept``)."""
        raise NotImplementedError


class StructuredOutputBackend:
    """Registered with ``register_structured_output_backends``; one instance per engine, in
    the main process. ``compile`` may run in a thread pool, off the engine loop."""

    def __init__(self, tokenizer: Any, vocab_size: int, config: Any):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.config = config

    def supports(self, constraint: dict[str, Any]) -> str | None:
        """None when this backend can express ``constraint``, else the reason it cannot."""
        raise NotImplementedError

    def compile(self, constraint: dict[str, Any]) -> Matcher:
        """Compile a constraint (``{"json": schema}``, ``{"regex": ...}``, ``{"choice": [...]}``,
        ``{"grammar": ...}``); raise InvalidRequestError for an invalid one."""
        raise NotImplementedError
