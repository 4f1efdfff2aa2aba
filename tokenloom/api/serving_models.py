"""The models the server answers to: the base model's served names and its LoRA adapters
(``--lora-modules``, and those loaded at runtime through ``POST /v1/load_lora_adapter`` when
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true). A request picks an adapter by its ``model``;
``/v1/models`` lists each adapter with the base model as its ``parent``."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenloom.api.server_protocol import ModelCard
from tokenloom.errors import ConfigError, InvalidRequestError, NotFoundError

if TYPE_CHECKING:
    from tokenloom.core.config import LoRAConfig
    from tokenloom.core.engine.protocol import EngineClient

# vLLM's switch, and tokenloom's own spelling of it
RUNTIME_LORA_UPDATING_ENV = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "TOKENLOOM_ALLOW_RUNTIME_LORA_UPDATING")
# whether a runtime load may name a Hugging Face Hub repo (downloaded by the server): off unless set
RUNTIME_LORA_HUB_ENV = "TOKENLOOM_ALLOW_RUNTIME_LORA_HUB"
_TRUE_VALUES = ("1", "true", "yes", "on")


def runtime_lora_updating_allowed() -> bool:
    return any(os.environ.get(name, "").strip().lower() in _TRUE_VALUES for name in RUNTIME_LORA_UPDATING_ENV)


def runtime_lora_hub_allowed() -> bool:
    return os.environ.get(RUNTIME_LORA_HUB_ENV, "").strip().lower() in _TRUE_VALUES


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry: ``name=path`` or ``{"name", "path", "base_model_name"}``."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str] | None) -> list[LoRAModulePath]:
    modules = []
    for value in values or []:
        text = value.strip()
        if text.startswith("{"):
            try:
                entry = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"--lora-modules: {value!r} is not valid JSON ({exc.msg})", param="lora-modules"
                ) from None
            if (
                not isinstance(entry, dict)
                or not isinstance(entry.get("name"), str)
                or not isinstance(entry.get("path"), str)
            ):
                raise ConfigError(
                    f'--lora-modules: {value!r} needs string "name" and "path" (and may give "base_model_name")',
                    param="lora-modules",
                )
            unknown = set(entry) - {"name", "path", "base_model_name"}
            if unknown:
                raise ConfigError(f"--lora-modules: unknown keys {sorted(unknown)} in {value!r}", param="lora-modules")
            modules.append(LoRAModulePath(entry["name"], entry["path"], entry.get("base_model_name")))
            continue
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules: {value!r} is neither name=path nor a JSON object", param="lora-modules")
        modules.append(LoRAModulePath(name.strip(), path.strip()))
    names = [module.name for module in modules]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ConfigError(f"--lora-modules names {', '.join(duplicates)} more than once", param="lora-modules")
    return modules


class ServedModels:
    """Base-model names and adapters, by the ``model`` name requests use."""

    def __init__(self, engine: EngineClient, base_model_names: list[str], max_model_len: int):
        self.engine = engine
        self.base_model_names = list(base_model_names)
        self.max_model_len = max_model_len
        self._adapters: dict[str, Any] = {}  # name -> LoRARequest
        # names of runtime loads under way: reserved before the engine checks the adapter, so a
        # concurrent load of the same name (or one past the limit) is refused before it starts
        self._loading: set[str] = set()
        self._num_static = 0
        self._next_lora_id = 1
        self._lock = threading.Lock()

    @property
    def _lora_config(self) -> LoRAConfig:
        return self.engine.lora_config

    @property
    def lora_enabled(self) -> bool:
        return self._lora_config.enable_lora

    @property
    def max_adapters(self) -> int:
        """How many adapters the server serves at once: ``--max-cpu-loras`` (vLLM's "LoRAs kept
        in CPU memory"; every served adapter fits the worker's cache), by default ``--max-loras``
        or the number of ``--lora-modules`` if that is larger."""
        lora = self._lora_config
        return lora.max_cpu_loras or max(lora.max_loras, self._num_static)

    def _new_request(self, name: str, path: str, base_model_name: str | None, allow_hub: bool = True) -> Any:
        from tokenloom.lora.request import LoRARequest

        if base_model_name is not None and base_model_name not in self.base_model_names:
            raise InvalidRequestError(
                f"LoRA adapter {name!r} is for base model {base_model_name!r}, but this server serves "
                f"{', '.join(repr(model) for model in self.base_model_names)}",
                param="base_model_name",
            )
        with self._lock:
            lora_id = self._next_lora_id
            self._next_lora_id += 1
        return LoRARequest(
            name, lora_id, path, base_model_name=base_model_name or self.base_model_names[0], allow_hub=allow_hub
        )

    def _check_new_name(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("lora_name must be a non-empty string", param="lora_name")
        if name in self.base_model_names:
            raise InvalidRequestError(f"{name!r} is the base model's name; give the adapter another", param="lora_name")
        if name in self._adapters:
            raise InvalidRequestError(f"the LoRA adapter {name!r} has already been loaded", param="lora_name")

    def _need_lora(self) -> None:
        if not self.lora_enabled:
            raise InvalidRequestError(
                "this server serves no LoRA adapters: start it with --enable-lora", param="lora_name"
            )

    def add_static(self, modules: list[LoRAModulePath]) -> None:
        """The ``--lora-modules`` adapters, each checked now: a bad one stops the start-up."""
        if modules and not self.lora_enabled:
            raise ConfigError("--lora-modules needs --enable-lora", param="enable-lora")
        self._num_static = len(modules)
        if len(modules) > self.max_adapters:
            raise ConfigError(
                f"--lora-modules names {len(modules)} adapters, more than --max-cpu-loras {self.max_adapters}",
                param="max-cpu-loras",
            )
        for module in modules:
            self._check_new_name(module.name)
            request = self._new_request(module.name, module.path, module.base_model_name)
            self.engine.resolve_lora(request)  # checked against the model before the server starts
            self._adapters[module.name] = request

    async def load(self, name: str, path: str, base_model_name: str | None = None) -> None:
        """A runtime load (``POST /v1/load_lora_adapter``): all or nothing. The name is reserved
        first, so two loads of one name never both reach the engine, and a failed check leaves
        nothing behind."""
        self._need_lora()
        if not isinstance(path, str) or not path:
            raise InvalidRequestError("lora_path must be a non-empty string", param="lora_path")
        with self._lock:
            self._check_new_name(name)
            if name in self._loading:
                raise InvalidRequestError(f"the LoRA adapter {name!r} is being loaded", param="lora_name")
            if len(self._adapters) + len(self._loading) >= self.max_adapters:
                raise InvalidRequestError(
                    f"this server serves at most {self.max_adapters} LoRA adapters (--max-cpu-loras) and has "
                    "that many: unload one with POST /v1/unload_lora_adapter first",
                    param="lora_name",
                    code="lora_adapter_limit",
                )
            self._loading.add(name)
        try:
            request = self._new_request(name, path, base_model_name, allow_hub=runtime_lora_hub_allowed())
            await _maybe_await(self.engine.add_lora(request))
            with self._lock:
                self._adapters[name] = request
        finally:
            with self._lock:
                self._loading.discard(name)

    async def unload(self, name: str, lora_int_id: int | None = None) -> None:
        with self._lock:
            request = self._adapters.get(name)
            if request is None or (lora_int_id is not None and lora_int_id != request.lora_int_id):
                raise NotFoundError(f"the LoRA adapter {name!r} cannot be found", param="lora_name")
            del self._adapters[name]
        await _maybe_await(self.engine.remove_lora(request.lora_int_id))

    # -- what requests use --------------------------------------------------------------------

    def check_model(self, requested: str | None) -> str:
        """The model name for the response: the requested one when it is served (an adapter
        or a base-model name); an unknown one is a 404 listing what is served."""
        if requested is None or requested == "":
            return self.base_model_names[0]
        if requested in self.base_model_names or requested in self._adapters:
            return requested
        served = [*self.base_model_names, *self._adapters]
        raise NotFoundError(
            f"the model {requested!r} does not exist; this server serves {', '.join(repr(name) for name in served)}",
            param="model",
        )

    def lora_request_for(self, model: str | None) -> Any:
        """The adapter a request's ``model`` names (None: the base model)."""
        return self._adapters.get(model) if model else None

    def model_cards(self, root: str) -> list[ModelCard]:
        cards = [ModelCard(id=name, root=root, max_model_len=self.max_model_len) for name in self.base_model_names]
        for name, request in list(self._adapters.items()):
            cards.append(
                ModelCard(
                    id=name, root=request.lora_path, parent=request.base_model_name, max_model_len=self.max_model_len
                )
            )
        return cards


async def _maybe_await(value: Any) -> Any:
    if asyncio.iscoroutine(value):
        return await value
    return value
