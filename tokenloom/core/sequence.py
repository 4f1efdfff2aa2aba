"""The engine's state of one sequence (:class:`EngineSequence`: one of a request's ``n`` outputs,
its tokens, status and what the scheduler and model runner keep for it)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenloom.core.sampling_params import PoolingParams, SamplingParams

if TYPE_CHECKING:
    from tokenloom.core.batch import TokenLogprobs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass
class EngineSequence:
    """The engine's state of one sequence (one of the ``n`` outputs of a user request).

    ``seq_id`` is the sequence's own id, the one the scheduler, the block manager and the
    worker key it by (``request_id`` itself when ``n`` is 1, else ``request_id#index``);
    ``request_id`` is the user request it belongs to (by default the same id)."""

    seq_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: set[int] = field(default_factory=set)
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    # the user request this sequence belongs to ("": seq_id), and its index among the n outputs
    request_id: str = ""
    index: int = 0
    prompt: str | None = None

    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at first scheduling
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # as the worker reported them, per sampled token / per computed prompt position; the
    # engine's output processor turns them into SampleLogprobs / PromptLogprobs
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # set for a pooling request: prefill-only, finished once its prompt is computed
    pooling_params: PoolingParams | None = None
    # the LoRA adapter this sequence runs with (a tokenloom.lora.request.LoRARequest; None: the base model)
    lora_request: Any = None
    # speculative decoding: tokens the proposer drafted, to verify in the next step
    draft_token_ids: list[int] = field(default_factory=list)
    # the prompt's images (tokenloom.core.multimodal.inputs.MultiModalItem), in prompt order
    mm_items: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = self.seq_id
        if self.sampling_params.logprobs is not None:
            self.logprobs = []

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        if self.status in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
        ):
            return str(self.status.value)
        if self.status is SequenceStatus.FINISHED_ERROR:
            return "error"
        return None
