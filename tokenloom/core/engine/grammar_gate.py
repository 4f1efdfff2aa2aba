"""Guided decoding inside the engine: :class:`GrammarGate` keeps a constrained request's
sequences out of the scheduler until its grammar has compiled, gives each sequence its own
matcher, advances the matchers by each step's tokens (a backend failure fails that sequence
alone) and forgets them when the request ends. Compiling itself (backends, the cache, time
limits) is :class:`~tokenloom.core.structured_output.StructuredOutputManager`'s.
"""

from __future__ import annotations

import concurrent.futures

from tokenloom.core.batch import SchedulerOutput
from tokenloom.core.engine.output_processor import RequestState
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.scheduler import Scheduler
from tokenloom.core.sequence import EngineSequence, SequenceStatus
from tokenloom.core.structured_output import CompiledConstraint, StructuredOutputManager
from tokenloom.core.structured_output_constraints import Constraint
from tokenloom.errors import InvalidRequestError

# how long an idle step waits for a grammar compile before looking at new commands again
GRAMMAR_WAIT_SECONDS = 0.05


class GrammarGate:
    """Between admission and the scheduler for constrained requests. ``manager`` is None when
    the engine runs without a tokenizer: then a constrained request is refused (400)."""

    def __init__(self, manager: StructuredOutputManager | None, scheduler: Scheduler):
        self.manager = manager
        self.scheduler = scheduler
        # constrained requests whose grammar is still compiling: kept out of the scheduler
        self.awaiting: list[tuple[RequestState, concurrent.futures.Future[CompiledConstraint]]] = []

    def manager_or_400(self) -> StructuredOutputManager:
        if self.manager is None:
            raise InvalidRequestError(
                "structured outputs need the tokenizer, which this server skipped (--skip-tokenizer-init)",
                param="structured_outputs",
            )
        return self.manager

    def submit(self, params: SamplingParams) -> concurrent.futures.Future[CompiledConstraint] | None:
        """See :meth:`LLMEngine.submit_structured_output`."""
        if params.structured_outputs is None:
            return None
        manager = self.manager_or_400()
        return manager.submit(*manager.resolve(params.structured_outputs))

    def check(
        self, params: SamplingParams, client: str | None = None
    ) -> concurrent.futures.Future[tuple[str, Constraint]] | None:
        """See :meth:`LLMEngine.check_structured_output`."""
        if params.structured_outputs is None:
            return None
        return self.manager_or_400().check(params.structured_outputs, client)

    def compile(
        self, backend_name: str, constraint: Constraint, client: str | None = None
    ) -> concurrent.futures.Future[CompiledConstraint]:
        """See :meth:`LLMEngine.compile_structured_output`."""
        return self.manager_or_400().submit(backend_name, constraint, client)

    def admit(self, state: RequestState, params: SamplingParams, grammar: CompiledConstraint | None) -> None:
        """Hand a generate request's sequences to the scheduler: now when it is unconstrained or
        its grammar is compiled (``grammar``, or found in the cache), else once it compiles.
        Raises (and queues nothing) for a constraint that cannot compile."""
        pending = None if grammar is not None else self.submit(params)
        if grammar is not None:
            self._admit_constrained(state, grammar)
        elif pending is not None and not pending.done():
            self.awaiting.append((state, pending))
        elif pending is not None:
            self._admit_constrained(state, pending.result())  # a bad constraint raises here
        else:
            self.scheduler.add_sequences(state.sequences)

    def _admit_constrained(self, state: RequestState, compiled: CompiledConstraint) -> None:
        """Queue the sequences of a request whose grammar compiled, each with its own matcher
        (n > 1: one per sequence); on an error nothing of it stays queued."""
        manager = self.manager_or_400()
        try:
            for seq in state.sequences:
                manager.add_sequence(seq, compiled)
            self.scheduler.add_sequences(state.sequences)
        except Exception:
            manager.remove_sequences(state.seq_ids)
            raise

    def admit_compiled(self, touched: dict[str, RequestState]) -> None:
        """Queue the requests whose grammar has compiled since the last step; a request whose
        grammar failed is finished with the error (and added to ``touched``)."""
        if not self.scheduler.has_unfinished_sequences():
            # nothing else to run: wait (briefly, so commands are still read) for a compile
            concurrent.futures.wait(
                [grammar for _, grammar in self.awaiting],
                timeout=GRAMMAR_WAIT_SECONDS,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )
        waiting = []
        for state, grammar in self.awaiting:
            if not grammar.done():
                waiting.append((state, grammar))
                continue
            try:
                self._admit_constrained(state, grammar.result())
            except Exception as exc:  # e.g. the schema did not compile: this request fails alone
                message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
                for seq in state.sequences:
                    seq.status = SequenceStatus.FINISHED_ERROR
                    seq.stop_reason = message
                touched[state.request_id] = state
        self.awaiting = waiting

    def fill_bitmask(self, scheduler_output: SchedulerOutput) -> None:
        """The step's allowed-token masks of its constrained sequences, set on ``scheduler_output``."""
        if self.manager is not None:
            scheduler_output.structured_output = self.manager.grammar_bitmask(
                scheduler_output, self.scheduler.get_sequence
            )

    def advance(self, seq: EngineSequence) -> None:
        """Feed the step's tokens to the sequence's matcher; a backend failure fails it alone."""
        if self.manager is None:
            return
        error = self.manager.advance(seq)
        if error is None or seq.status is SequenceStatus.FINISHED_ERROR:
            return
        seq.stop_reason = error
        if seq.finished:
            # it ended on the end-of-sequence token the failed row was limited to
            seq.status = SequenceStatus.FINISHED_ERROR
        else:
            self.scheduler.finish_sequences([seq.seq_id], SequenceStatus.FINISHED_ERROR)

    def forget(self, state: RequestState) -> None:
        """Drop a finished or aborted request's matchers, and its compile if still waiting."""
        if self.manager is not None:
            self.manager.remove_sequences(state.seq_ids)
            self.awaiting = [item for item in self.awaiting if item[0] is not state]

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown()
