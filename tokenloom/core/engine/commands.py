"""What the server's event loop asks of the engine thread (:class:`AsyncLLM`): typed commands
put on one queue and applied by the engine thread between steps, in order."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any

from tokenloom.core.engine.input_processor import PreparedPrompt
from tokenloom.core.sampling_params import PoolingParams, SamplingParams


@dataclass(frozen=True)
class AddRequest:
    """Admit a generate request whose prompt was already prepared (and whose grammar, if any,
    already compiled) on the event loop."""

    request_id: str
    sampling_params: SamplingParams
    prepared: PreparedPrompt
    priority: int
    arrival_time: float
    # the LoRA adapter it runs with, already checked (tokenloom.lora.request.LoRARequest), or None
    lora_request: Any = None
    # its compiled constraint (tokenloom.core.structured_output.CompiledConstraint), or None
    grammar: Any = None


@dataclass(frozen=True)
class AddPoolingRequest:
    """Admit a pooling request whose prompt was already prepared."""

    request_id: str
    pooling_params: PoolingParams
    prepared: PreparedPrompt
    priority: int
    arrival_time: float


@dataclass(frozen=True)
class AbortRequest:
    """Stop a request (its client went away, or it was aborted) and free what it holds."""

    request_id: str


@dataclass(frozen=True)
class ResetPrefixCache:
    """Forget every cached prefix block; ``done`` is resolved once the engine has."""

    done: concurrent.futures.Future[None]


EngineCommand = AddRequest | AddPoolingRequest | AbortRequest | ResetPrefixCache
