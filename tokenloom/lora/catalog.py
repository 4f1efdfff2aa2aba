"""The engine's side of LoRA: :class:`LoRACatalog` turns a :class:`LoRARequest` into one the
worker can load (its path resolved by the model-source plugins to a local folder) after
checking the adapter against the base model, once per adapter id, so a bad adapter is a 400
for its request and never reaches a step."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

from tokenloom.errors import InvalidRequestError
from tokenloom.lora.peft import (
    CONFIG_FILE,
    WEIGHT_FILES,
    LoRAAdapterError,
    UnusableAdapterPathError,
    load_peft_adapter,
    module_shapes_from_config,
)
from tokenloom.lora.request import LoRARequest

logger = logging.getLogger(__name__)


def unusable_path_error(lora_request: LoRARequest) -> LoRAAdapterError:
    """The one answer for every path that does not lead to adapter files this server may read:
    missing, not a directory, unreadable, without the files, or a Hub id it may not download.
    One message for all, so a client cannot probe which paths exist on the server."""
    return LoRAAdapterError(
        f"LoRA adapter {lora_request.lora_name!r}: {lora_request.lora_path!r} is not a usable adapter: give a "
        f"directory the server can read holding {CONFIG_FILE} and {' or '.join(WEIGHT_FILES)}, or an adapter "
        "name a model source resolves (a Hugging Face repo id only where the server allows Hub downloads)",
        param="lora_path",
    )


class LoRACatalog:
    """The adapters the engine has accepted, by id. Thread-safe: the server checks adapters on
    its event loop while the engine thread admits requests.

    :param resolve_path: ``(tag, allow_hub)`` -> a local folder, for a tag (folder, packaged
        adapter name, Hub id when ``allow_hub``).
    :param dtype: ``--lora-dtype`` when given (None for auto): weights must be finite in it.
    """

    def __init__(
        self,
        *,
        max_lora_rank: int,
        hf_config: Any,
        resolve_path: Callable[[str, bool], str],
        model_name: str,
        dtype: Any = None,
    ):
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
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
            local_path = self.resolve_path(lora_request.lora_path, lora_request.allow_hub)
            load_peft_adapter(
                local_path,
                max_lora_rank=self.max_lora_rank,
                module_shapes=self.module_shapes,
                base_model_description=self.model_name,
                dtype=self.dtype,
            )
        except UnusableAdapterPathError as exc:
            logger.info("LoRA adapter %r refused: %s", lora_request.lora_name, exc.message)
            raise unusable_path_error(lora_request) from None
        except LoRAAdapterError:
            raise
        except Exception as exc:  # a model source's own error: the adapter cannot be found
            # (the reason, which may say what exists where, goes to the log, not the client)
            logger.info("LoRA adapter %r: cannot resolve %r: %s", lora_request.lora_name, lora_request.lora_path, exc)
            raise unusable_path_error(lora_request) from None
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
