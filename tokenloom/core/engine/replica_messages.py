"""What crosses the process boundary between the server and a data-parallel replica: frozen
dataclasses (pickled through a pipe, or handed to and from a Ray actor), matched by type on
each side, and :class:`PackedError`, an exception as plain data.

Server -> replica: :class:`Generate`, :class:`Encode`, :class:`~tokenloom.core.engine.commands.AbortRequest`,
:class:`Call` (one of :data:`ReplicaCall`), :class:`Shutdown`. Replica -> server, in batches:
:class:`Ready` or :class:`Failed` once at start, then :class:`Output`, :class:`Reply` and, last
in every batch, :class:`Stats`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenloom.core.engine.commands import AbortRequest
from tokenloom.core.engine.engine_stats import EngineStats
from tokenloom.core.outputs import PoolingRequestOutput, RequestOutput
from tokenloom.core.sampling_params import PoolingParams, SamplingParams


@dataclass(frozen=True)
class PackedError:
    """An exception as plain data: tokenloom's errors take keyword-only arguments (``param``,
    ``code``) that pickling an exception drops or cannot pass back to ``__init__``."""

    error_class: type[BaseException]
    message: str
    attributes: dict[str, Any]

    @classmethod
    def of(cls, exc: BaseException) -> PackedError:
        import pickle

        attributes = {}
        for name, value in vars(exc).items():
            try:
                pickle.dumps(value)
            except Exception:
                continue
            attributes[name] = value
        error_class = type(exc)
        try:
            pickle.dumps(error_class)
        except Exception:  # a class only that process knows: its name still says what went wrong
            return cls(RuntimeError, f"{error_class.__name__}: {exc}", {})
        return cls(error_class, str(exc), attributes)

    def unpack(self) -> BaseException:
        try:
            exc = self.error_class.__new__(self.error_class)
            BaseException.__init__(exc, self.message)
            exc.__dict__.update(self.attributes)
            return exc
        except Exception:
            return RuntimeError(f"{self.error_class.__name__}: {self.message}")


# -- server -> replica ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Generate:
    """Admit a generate request; the replica prepares it (tokenizes, compiles its grammar,
    resolves its adapter) as a single engine would."""

    request_id: str
    prompt: Any
    sampling_params: SamplingParams
    priority: int
    lora_request: Any
    # who sent it (an API key's hash or a peer address): its grammar compiles count against them
    client: str | None


@dataclass(frozen=True)
class Encode:
    """Admit a pooling request."""

    request_id: str
    prompt: Any
    pooling_params: PoolingParams
    priority: int


@dataclass(frozen=True)
class ResolveLora:
    """Check an adapter against the model; the reply is the adapter with its path made local."""

    lora_request: Any


@dataclass(frozen=True)
class AddLora:
    """Check an adapter so requests can name it; the reply is True."""

    lora_request: Any


@dataclass(frozen=True)
class RemoveLora:
    """Forget an adapter; the reply says whether it was loaded."""

    lora_int_id: int


@dataclass(frozen=True)
class ResetPrefixCacheCall:
    """Forget every cached prefix block; the reply is None once the replica's engine has."""


# the calls a replica answers with a Reply
ReplicaCall = ResolveLora | AddLora | RemoveLora | ResetPrefixCacheCall


@dataclass(frozen=True)
class Call:
    """A call the replica answers with a :class:`Reply` carrying the same ``call_id``."""

    call_id: int
    call: ReplicaCall


@dataclass(frozen=True)
class Shutdown:
    """Stop the replica's engine and end the replica."""


ToReplica = Generate | Encode | AbortRequest | Call | Shutdown


# -- replica -> server ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """The replica built its engine; ``facts`` are the engine's answers to the server's
    questions about the model (see ``FACT_NAMES`` in replica_host)."""

    facts: dict[str, Any]


@dataclass(frozen=True)
class Failed:
    """The replica could not build its engine."""

    error: PackedError


@dataclass(frozen=True)
class Output:
    """One output of a request, or the error that ended it."""

    request_id: str
    output: RequestOutput | PoolingRequestOutput | PackedError


@dataclass(frozen=True)
class Reply:
    """The answer to a :class:`Call`: its value, or the error it raised."""

    call_id: int
    ok: bool
    value: Any


@dataclass(frozen=True)
class Stats:
    """Last in every batch (and a heartbeat when there is nothing else): the replica's stats,
    and why its engine stopped (None while it runs)."""

    stats: EngineStats
    dead_reason: str | None


FromReplica = Ready | Failed | Output | Reply | Stats
