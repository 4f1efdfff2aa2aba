"""The engine's side of LoRA: :class:`LoRACatalog` turns a :class:`LoRARequest` into one the
worker can load (its path resolved by the model-source plugins to a local folder) after
checking the adapter against the base model, once per adapter id, so a bad adapter is a 400
for its request and never reaches a step."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from tokenloom.errors import InvalidRequestError
from tokenloom.lora.peft import LoRAAdapterError, load_peft_adapter, module_shapes_from_config
from tokenloom.lora.request import LoRARequest


class LoRACatalog:
    """The adapters the engine has accepted, by id. Thread-safe: the server checks adapters on
    its event loop while the engine thread admits requests.

    :param resolve_path: a tag (folder, packaged adapter name, Hub id) -> a local folder.
    """

    def __init__(
        self,
        *,
        max_lora_rank: int,
        hf_config: Any,
        resolve_path: Callable[[str], str],
        model_name: str,
    ):
        self.max_lora_rank = max_lora_rank
        self.module_shapes = module_shapes_from_config(hf_config)
        self.resolve_path = resolve_path
        self.model_name = model_name
        self._accepted: dict[int, tuple[LoRARequest, LoRARequest]] = {}  # id -> (as given, resolved)
        self._lock = threading.Lock()

    def resolve(self, lora_request: LoRARequest) -> LoRARequest:
        """The request with a local path, checked; raises LoRAAdapterError (400) naming what
        does not fit (rank, targets, shapes of another base model)."""
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(
                f"lora_request must be a LoRARequest, got {type(lora_request).__name__}", param="lora_request"
            )
        with self._lock:
            accepted = self._accepted.get(lora_request.lora_int_id)
        if accepted is not None:
            given, resolved = accepted
            asked = (lora_request.lora_name, lora_request.lora_path)
            if asked not in ((given.lora_name, given.lora_path), (resolved.lora_name, resolved.lora_path)):
                raise InvalidRequestError(
                    f"lora_int_id {lora_request.lora_int_id} already names adapter {given.lora_name!r} "
                    f"({given.lora_path}); give {lora_request.lora_name!r} an id of its own",
                    param="lora_int_id",
                )
            return resolved
        try:
            local_path = self.resolve_path(lora_request.lora_path)
        except LoRAAdapterError:
            raise
        except Exception as exc:  # a model source's own error: the adapter cannot be found
            message = getattr(exc, "message", None) or str(exc)
            raise LoRAAdapterError(
                f"LoRA adapter {lora_request.lora_name!r}: cannot find {lora_request.lora_path!r}: {message}",
                param="lora_path",
            ) from None
        load_peft_adapter(
            local_path,
            max_lora_rank=self.max_lora_rank,
            module_shapes=self.module_shapes,
            base_model_description=self.model_name,
        )
        resolved = dataclasses.replace(lora_request, lora_path=local_path)
        with self._lock:
            self._accepted.setdefault(lora_request.lora_int_id, (lora_request, resolved))
        return resolved

    def forget(self, lora_int_id: int) -> None:
        with self._lock:
            self._accepted.pop(lora_int_id, None)

    def name_of(self, lora_int_id: int) -> str | None:
        with self._lock:
            accepted = self._accepted.get(lora_int_id)
        return None if accepted is None else accepted[0].lora_name
