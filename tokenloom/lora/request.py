""":class:`LoRARequest`, which adapter a request runs with (vLLM's offline type). Plain data:
it travels from the engine to the workers inside the scheduler's output."""

from __future__ import annotations

from dataclasses import dataclass

from tokenloom.errors import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    """``LoRARequest(lora_name, lora_int_id, lora_path)`` as in vLLM.

    :param lora_name: the adapter's name (the ``model`` a server request names).
    :param lora_int_id: a positive id, unique per adapter: prefix-cache keys and the worker's
        slots are keyed by it, so two adapters must never share one.
    :param lora_path: where the adapter is: a local folder, a pip-packaged adapter or a Hub id
        (resolved by the model-source plugins); the engine replaces it with the local folder.
    :param base_model_name: the served model the adapter belongs to (listed as its ``parent``).
    :param allow_hub: whether ``lora_path`` may be a Hugging Face Hub repo id (tokenloom's own
        field): the server sets it False for runtime loads unless
        ``TOKENLOOM_ALLOW_RUNTIME_LORA_HUB`` is true, so a client cannot make it download.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    allow_hub: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError("a LoRA adapter needs a non-empty name", param="lora_name")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidRequestError(
                f"lora_int_id must be a positive integer, got {self.lora_int_id!r}", param="lora_int_id"
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidRequestError(f"LoRA adapter {self.lora_name!r} needs a path", param="lora_path")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of :attr:`lora_int_id`."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
