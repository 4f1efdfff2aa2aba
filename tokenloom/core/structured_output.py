"""Guided decoding, the engine's side: :class:`StructuredOutputManager` picks a backend per
request, compiles in a thread pool (``structured_output_compile.py``) behind an LRU cache, and
each step fills the allowed-token bitmask of every constrained sequence that samples, then
advances its matcher by the sampled token. The plugin interface (:class:`StructuredOutputBackend`,
:class:`Matcher`, the bitmask layout) is ``structured_output_backend.py``; how a request's dict
becomes a constraint is ``structured_output_constraints.py``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenloom.core.batch import StructuredOutputMasks
from tokenloom.core.structured_output_backend import (
    Matcher,
    StructuredOutputBackend,
    allocate_bitmask,
    set_allowed_tokens,
)
from tokenloom.core.structured_output_compile import COMPILE_THREADS, DEFAULT_COMPILE_TIMEOUT, CompilePool
from tokenloom.core.structured_output_constraints import (
    AUTO,
    BackendOptions,
    Constraint,
    parse_backend_option,
    parse_constraint,
)
from tokenloom.errors import ConfigError, InvalidRequestError, OverloadedError

if TYPE_CHECKING:
    import torch

    from tokenloom.core.sequence import EngineSequence

logger = logging.getLogger(__name__)

# --structured-outputs-request-backends: a request may name any backend / only the server's
ANY_BACKEND = "any"
NO_OTHER_BACKEND = "none"
COMPILE_CACHE_SIZE = 256


# -- the engine side ---------------------------------------------------------------------


@dataclass
class CompiledConstraint:
    """A compiled constraint and the backend that makes its matchers."""

    backend_name: str
    backend: StructuredOutputBackend
    compiled: Any

    def new_matcher(self) -> Matcher:
        return self.backend.new_matcher(self.compiled)


@dataclass
class _SequenceGrammar:
    """One constrained sequence: its matcher and how much of its output the matcher has seen."""

    matcher: Matcher
    backend_name: str
    reasoning_parser: Any = None
    reasoning_ended: bool = True
    # output position where the constraint starts (after the reasoning section)
    constraint_start: int = 0
    # output tokens from constraint_start on that the matcher has consumed
    num_processed: int = 0
    num_preemptions: int = 0
    error: str | None = None


@dataclass
class StructuredOutputStats:
    compiles: int = 0
    cache_hits: int = 0
    matcher_resets: int = 0
    replayed_tokens: int = 0


class StructuredOutputManager:
    """The engine's guided-decoding state: backends, the compile cache and pool, and one
    :class:`_SequenceGrammar` per constrained sequence. Thread-safe for ``check``,
    ``resolve`` and ``submit`` (the server's event loop calls ``check`` and ``submit``, the
    pool's threads ``resolve``); the rest runs on the engine thread."""

    def __init__(
        self,
        config: Any,
        registry: Any,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: list[int],
        reasoning_parser_class: type | None = None,
        cache_size: int = COMPILE_CACHE_SIZE,
    ):
        self.registry = registry
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.reasoning_parser_class = reasoning_parser_class
        name, options = parse_backend_option(config.backend)
        self.default_backend = name
        self.options = BackendOptions(
            disable_fallback=options.disable_fallback or config.disable_fallback,
            disable_any_whitespace=options.disable_any_whitespace or config.disable_any_whitespace,
            disable_additional_properties=options.disable_additional_properties or config.disable_additional_properties,
        )
        if name != AUTO:
            registry.entry(name)  # an unknown name fails at start-up, listing the known ones
        self.request_backends = parse_request_backends(getattr(config, "request_backends", ANY_BACKEND), registry)
        self.cache_size = cache_size
        self.stats = StructuredOutputStats()
        self._tokenizer_key = _tokenizer_fingerprint(tokenizer)
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str, str], concurrent.futures.Future[CompiledConstraint]] = OrderedDict()
        self._pool = CompilePool(COMPILE_THREADS, float(getattr(config, "compile_timeout", DEFAULT_COMPILE_TIMEOUT)))
        self._sequences: dict[str, _SequenceGrammar] = {}

    # -- choosing a backend and compiling (any thread) ---------------------------------------

    def backend(self, name: str) -> StructuredOutputBackend:
        with self._lock:
            if name not in self._backends:
                backend_class = self.registry.get(name)
                self._backends[name] = backend_class(self.tokenizer, self.vocab_size, self.eos_token_ids, self.options)
            return self._backends[name]

    def resolve(self, request: dict[str, Any]) -> tuple[str, Constraint]:
        """Check a request's constraint and choose its backend: (backend name, constraint).

        A backend named in the request must express it (no fallback); the server's default
        falls back to the other backends in registration order unless fallback is disabled.
        """
        constraint, requested, no_fallback = parse_constraint(request, self.options)
        if requested is not None and requested not in self.registry:
            raise InvalidRequestError(
                f"unknown guided_decoding_backend {requested!r}; available: {', '.join(self.registry.names())}",
                param="guided_decoding_backend",
            )
        if requested is not None and requested != self.default_backend and not self._may_request(requested):
            allowed = sorted({name for name in self.request_backends or () if name != AUTO} - {self.default_backend})
            raise InvalidRequestError(
                f"this server does not let a request choose the guided-decoding backend {requested!r} "
                f"(--structured-outputs-request-backends); its backend is {self.default_backend!r}"
                + (f", and a request may also name {', '.join(allowed)}" if allowed else "")
                + ": remove backend / guided_decoding_backend from the request",
                param="guided_decoding_backend",
            )
        names = self.registry.names()
        if requested is not None:
            candidates = [requested]
        else:
            first = names[0] if self.default_backend == AUTO and names else self.default_backend
            candidates = [first]
            if not (self.options.disable_fallback or no_fallback):
                candidates += [name for name in names if name != first]
        reasons = []
        for name in candidates:
            try:
                reason = self.backend(name).supports(constraint)
            except Exception as exc:  # e.g. the backend's library is not installed
                reason = f"unavailable ({type(exc).__name__}: {exc})"
            if reason is None:
                return name, constraint
            reasons.append(f"{name}: {reason}")
        raise InvalidRequestError(
            f"no guided-decoding backend can express {constraint.describe()}: " + "; ".join(reasons),
            param="structured_outputs",
        )

    def _may_request(self, name: str) -> bool:
        return self.request_backends is None or name in self.request_backends

    def check(
        self, request: dict[str, Any], client: str | None = None
    ) -> concurrent.futures.Future[tuple[str, Constraint]]:
        """:meth:`resolve` run in the compile pool, as ``client``'s job, bounded by the compile
        time limit (a Future): the server's event loop never walks a schema itself."""
        return self._pool.submit(
            lambda: self.resolve(request),
            "checking a guided-decoding constraint",
            client,
            lambda timeout: InvalidRequestError(
                f"checking the guided-decoding constraint took longer than the server's limit of {timeout:g}s "
                "(--structured-outputs-compile-timeout); send a smaller schema",
                param="structured_outputs",
            ),
        )

    def submit(
        self, backend_name: str, constraint: Constraint, client: str | None = None
    ) -> concurrent.futures.Future[CompiledConstraint]:
        """The compiled constraint, from the cache or compiled in the pool as ``client``'s job
        (a Future). A compile that failed, or overran its limit, stays failed in the cache: the
        same constraint gets the same 400 at once instead of burning the CPU again."""
        key = (backend_name, constraint.key, self._tokenizer_key)
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not _refused(future):
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                return future
            future = self._pool.submit(
                lambda: self._compile(backend_name, constraint), f"compiling {constraint.describe()}", client
            )
            self._cache[key] = future
            self.stats.compiles += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return future

    def _compile(self, backend_name: str, constraint: Constraint) -> CompiledConstraint:
        backend = self.backend(backend_name)
        try:
            compiled = backend.compile(constraint)
        except InvalidRequestError:
            raise
        except Exception as exc:
            raise InvalidRequestError(
                f"{backend_name} cannot compile {constraint.describe()}: {clean_error(exc)}", param="structured_outputs"
            ) from exc
        return CompiledConstraint(backend_name, backend, compiled)

    def shutdown(self) -> None:
        self._pool.shutdown()

    # -- sequences (engine thread) -----------------------------------------------------------

    def add_sequence(self, seq: EngineSequence, compiled: CompiledConstraint) -> None:
        state = _SequenceGrammar(compiled.new_matcher(), compiled.backend_name, num_preemptions=seq.num_preemptions)
        if self.reasoning_parser_class is not None:
            # the parser judges generated tokens only (its contract): with none yet, a parser
            # that knows the output has no reasoning section says so, and the constraint starts
            # at the first token; otherwise it starts after the token that ends the section
            state.reasoning_parser = self.reasoning_parser_class(self.tokenizer)
            state.reasoning_ended = self._reasoning_ended(state, seq.output_token_ids)
            state.constraint_start = len(seq.output_token_ids)
        self._sequences[seq.seq_id] = state

    def remove_sequences(self, seq_ids: Iterable[str]) -> None:
        for seq_id in seq_ids:
            self._sequences.pop(seq_id, None)

    def is_constrained(self, seq_id: str) -> bool:
        return seq_id in self._sequences

    def grammar_bitmask(
        self, scheduler_output: Any, get_sequence: Callable[[str], EngineSequence | None]
    ) -> StructuredOutputMasks | None:
        """The bitmask rows of the constrained sequences that sample this step.

        A sequence verifying draft tokens gets one row per position, each computed with the
        drafts before it accepted (then taken back); its drafts are cut at the first one the
        grammar rejects (``scheduler_output.trim_draft_tokens``), which could never be accepted.
        """
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        rows: list[tuple[str, _SequenceGrammar, EngineSequence]] = []
        for seq_id, num_tokens in list(scheduler_output.num_scheduled_tokens.items()):
            state = self._sequences.get(seq_id)
            seq = get_sequence(seq_id) if state is not None else None
            if state is None or seq is None:
                continue
            num_drafts = len(spec_tokens.get(seq_id, ()))
            if seq.num_computed_tokens + num_tokens - num_drafts < seq.num_tokens:
                continue  # a prompt chunk that samples nothing
            if state.error is None:
                self._sync(seq, state)
            if not state.reasoning_ended or state.error is not None:
                # while it reasons a draft could end the reasoning, after which the grammar applies
                scheduler_output.trim_draft_tokens(seq_id, 0)
            if state.reasoning_ended:
                rows.append((seq_id, state, seq))
        if not rows:
            return None
        bitmask = allocate_bitmask(sum(1 + len(spec_tokens.get(seq_id, ())) for seq_id, _, _ in rows), self.vocab_size)
        row_seq_ids: list[str] = []
        for seq_id, state, seq in rows:
            row = len(row_seq_ids)
            row_seq_ids.append(seq_id)
            try:
                if state.error is not None or state.matcher.is_terminated():
                    set_allowed_tokens(bitmask[row], self.eos_token_ids)
                else:
                    state.matcher.fill_bitmask(bitmask, row)
            except Exception as exc:  # fails this request only, after this step
                logger.exception("structured output backend %s failed on request %s", state.backend_name, seq_id)
                state.error = f"{state.backend_name} failed computing the allowed tokens: {clean_error(exc)}"
                set_allowed_tokens(bitmask[row], self.eos_token_ids)
                scheduler_output.trim_draft_tokens(seq_id, 0)
                continue
            drafts = spec_tokens.get(seq_id)
            if drafts:
                num_kept = self._draft_rows(seq, state, drafts, bitmask, row + 1)
                scheduler_output.trim_draft_tokens(seq_id, num_kept)
                row_seq_ids.extend([seq_id] * num_kept)
        return StructuredOutputMasks(row_seq_ids, bitmask[: len(row_seq_ids)].numpy())

    def _draft_rows(
        self, seq: EngineSequence, state: _SequenceGrammar, drafts: list[int], bitmask: torch.Tensor, first_row: int
    ) -> int:
        """Fill the rows after each draft the grammar accepts (from ``first_row``), then take
        the drafts back; returns how many drafts it accepted (the rest are never verified)."""
        matcher = state.matcher
        num_accepted = num_kept = 0
        try:
            for draft in drafts:
                if matcher.is_terminated() or not matcher.accept_token(draft):
                    break
                num_accepted += 1
                if matcher.is_terminated():
                    set_allowed_tokens(bitmask[first_row + num_accepted - 1], self.eos_token_ids)
                else:
                    matcher.fill_bitmask(bitmask, first_row + num_accepted - 1)
                num_kept = num_accepted
        except Exception:  # a backend failing on a draft only costs the speculation
            logger.exception("structured output backend %s failed on a draft token", state.backend_name)
            num_kept = 0
        finally:
            self._take_back(seq, state, num_accepted)
        return num_kept

    def _take_back(self, seq: EngineSequence, state: _SequenceGrammar, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        try:
            state.matcher.rollback(num_tokens)
        except NotImplementedError:  # a backend without rollback replays the real output
            self._replay(state, seq.output_token_ids)
            self._sync(seq, state)

    def advance(self, seq: EngineSequence) -> str | None:
        """Feed a sequence's new output tokens to its matcher; the error message when the
        backend failed or rejected a token (the engine then fails that request)."""
        state = self._sequences.get(seq.seq_id)
        if state is None:
            return None
        if state.error is None:
            try:
                self._sync(seq, state)
            except Exception as exc:
                logger.exception("structured output backend %s failed on request %s", state.backend_name, seq.seq_id)
                state.error = f"{state.backend_name} failed: {clean_error(exc)}"
        return state.error

    def _sync(self, seq: EngineSequence, state: _SequenceGrammar) -> None:
        """Bring the matcher in line with the request's output tokens: rebuild it after a
        preemption, notice the end of reasoning, accept new tokens."""
        output = seq.output_token_ids
        if seq.num_preemptions != state.num_preemptions:
            # the worker rebuilt this request from scratch: rebuild the grammar state too, so it
            # cannot drift from the tokens the request really holds
            state.num_preemptions = seq.num_preemptions
            self._replay(state, output)
        if not state.reasoning_ended:
            if not self._reasoning_ended(state, output):
                return
            state.reasoning_ended = True
            state.constraint_start = len(output)
            state.num_processed = 0
        constrained = output[state.constraint_start :]
        if len(constrained) < state.num_processed:  # tokens were taken back
            try:
                state.matcher.rollback(state.num_processed - len(constrained))
                state.num_processed = len(constrained)
            except NotImplementedError:
                self._replay(state, output)
        matcher = state.matcher
        for token_id in constrained[state.num_processed :]:
            # after the end only end-of-sequence tokens were allowed (ignore_eos may keep going)
            if not matcher.is_terminated() and not matcher.accept_token(token_id):
                state.error = (
                    f"the {state.backend_name} grammar rejected the sampled token {token_id} "
                    f"({self._token_text(token_id)!r})"
                )
                return
            state.num_processed += 1

    def _replay(self, state: _SequenceGrammar, output: list[int]) -> None:
        state.matcher.reset()
        state.num_processed = 0
        self.stats.matcher_resets += 1
        if state.reasoning_ended:
            self.stats.replayed_tokens += len(output) - state.constraint_start

    def _reasoning_ended(self, state: _SequenceGrammar, token_ids: list[int]) -> bool:
        try:
            return bool(state.reasoning_parser.is_reasoning_end(list(token_ids)))
        except NotImplementedError:
            logger.warning(
                "reasoning parser %s has no is_reasoning_end: constraining from the first token",
                type(state.reasoning_parser).__name__,
            )
            return True

    def _token_text(self, token_id: int) -> str:
        try:
            return str(self.tokenizer.decode([token_id]))
        except Exception:
            return "?"


def _refused(future: concurrent.futures.Future[Any]) -> bool:
    """A cached compile that never ran for reasons other than its constraint (cancelled, or a
    429 while its client's slots were full): compiled afresh when asked again."""
    if not future.done():
        return False
    return future.cancelled() or isinstance(future.exception(), OverloadedError)


def parse_request_backends(value: str | None, registry: Any) -> frozenset[str] | None:
    """``--structured-outputs-request-backends``: None when a request may name any backend
    (``any``), else the names it may use besides the server's own (``none``: no other)."""
    text = (value or ANY_BACKEND).strip()
    if text == ANY_BACKEND:
        return None
    if text == NO_OTHER_BACKEND:
        return frozenset()
    names = frozenset(name.strip() for name in text.split(",") if name.strip())
    unknown = sorted(name for name in names if name not in registry)
    if unknown:
        raise ConfigError(
            f"--structured-outputs-request-backends: unknown backend(s) {', '.join(unknown)}; give "
            f"{ANY_BACKEND!r}, {NO_OTHER_BACKEND!r} or a comma-separated list of: {', '.join(registry.names())}",
            param="structured-outputs-request-backends",
        )
    return names


def clean_error(exc: BaseException) -> str:
    """A backend's error message without native-code location prefixes (xgrammar prepends
    ``[time] /path/file.cc:123: ``)."""
    import re

    text = str(exc).strip() or type(exc).__name__
    text = re.sub(r"^\[[0-9:]+\]\s+\S+:\d+:\s*", "", text)
    return text.splitlines()[0][:500] if text else type(exc).__name__


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    """Identifies a vocabulary: compiled grammars are only valid for the same token table."""
    if tokenizer is None:
        return "none"
    digest = hashlib.sha1()
    digest.update(str(getattr(tokenizer, "name_or_path", "")).encode())
    try:
        vocab = tokenizer.get_vocab()
    except Exception:
        return digest.hexdigest() + f"-{id(tokenizer)}"
    for token, token_id in sorted(vocab.items(), key=lambda item: item[1]):
        digest.update(f"{token_id}\x00{token}\x01".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


__all__ = ["CompiledConstraint", "StructuredOutputManager"]
