"""Per-request logits processors (the ``logits_processor`` plugin kind): the interface a
processor honours, the plain-data :class:`LogitsProcessorSpec` that names one for the worker,
and the checks that turn a request's ``logits_processors`` field (registered names, or
qualified names allowed by ``--logits-processor-pattern``) into specs.

A processor is built in the worker, once per request that uses it, and the sampler calls it
on that request's row of logits (a float32 ``[vocab]`` tensor) each step, before the built-in
masks, biases and penalties, as vLLM's per-request processors were.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenloom.errors import ConfigError, InvalidRequestError
from tokenloom.plugins.registry import Registry, resolve_target

# a request may name at most this many processors: each runs in Python on every step
MAX_REQUEST_LOGITS_PROCESSORS = 16

# what the sampler calls: (prompt token ids, output token ids so far, logits row) -> logits row
ProcessorFn = Callable[[Sequence[int], Sequence[int], torch.Tensor], torch.Tensor]


class LogitsProcessor:
    """The contract of a logits processor (subclassing is optional: any callable with this
    signature, or vLLM's older ``(output_token_ids, logits)`` form, is accepted).

    The class (or factory) is called once per request that uses it, in the worker, with the
    ``args`` and ``kwargs`` the request gave (none for a processor named by a plain string or
    given with ``--logits-processors``); an instance may keep state for that request's life.
    """

    def __call__(
        self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int], logits: torch.Tensor
    ) -> torch.Tensor:
        """Return the request's logits for the next token.

        :param prompt_token_ids: the request's prompt.
        :param output_token_ids: the tokens generated so far (empty at the first step).
        :param logits: a float32 ``[vocab_size]`` tensor on the model's device; it may be
            changed in place and returned, or a new tensor of the same shape returned.
        :returns: the processed logits. Set a token to ``-inf`` to ban it.

        Called once per sampled token, on the engine's thread; an exception fails this request
        alone (its output ends with finish reason ``error``).
        """
        raise NotImplementedError


@dataclass(frozen=True)
class LogitsProcessorSpec:
    """A processor as plain data (it crosses to worker processes): what the request called it,
    where its factory lives (``"module:attr"``), and the arguments it is built with."""

    name: str
    target: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    # a plain string names the processor itself when it is a function (vLLM's form); a class,
    # or any target given with args/kwargs, is a factory called to build the processor
    construct: bool = True


def build_processor(spec: LogitsProcessorSpec | Callable[..., Any]) -> ProcessorFn:
    """The callable the sampler runs for ``spec`` (a spec, or an already built callable as
    ``SamplingParams(logits_processors=[fn])`` may hold offline)."""
    if isinstance(spec, LogitsProcessorSpec):
        factory = resolve_target(spec.target)
        if inspect.isclass(factory) or spec.construct:
            processor = factory(*spec.args, **spec.kwargs)
        else:
            processor = factory
        name = spec.name
    else:
        processor, name = spec, getattr(spec, "__qualname__", repr(spec))
    if not callable(processor):
        raise TypeError(f"logits processor {name!r} built {processor!r}, which is not callable")
    return _normalise_call(processor, name)


def _normalise_call(processor: Callable[..., Any], name: str) -> ProcessorFn:
    """vLLM accepted ``fn(output_token_ids, logits)`` and ``fn(prompt_token_ids,
    output_token_ids, logits)``: both become the three-argument form."""
    try:
        parameters = [
            p
            for p in inspect.signature(processor).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        ]
        takes_var_args = any(p.kind is p.VAR_POSITIONAL for p in inspect.signature(processor).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature: assume the full form
        return processor
    if len(parameters) == 3 or takes_var_args:
        return processor
    if len(parameters) == 2:
        return lambda prompt_token_ids, output_token_ids, logits: processor(output_token_ids, logits)
    raise TypeError(
        f"logits processor {name!r} takes {len(parameters)} arguments; it must take "
        "(prompt_token_ids, output_token_ids, logits) or (output_token_ids, logits)"
    )


def _qualified_target(name: str) -> str:
    """``pkg.mod.Class`` (vLLM's qualified name) or ``pkg.mod:Class`` -> ``"pkg.mod:Class"``."""
    if ":" in name:
        return name
    module, _, attr = name.rpartition(".")
    if not module:
        return name  # resolve_target names the problem
    return f"{module}:{attr}"


_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_MODULE_NAME = re.compile(rf"{_IDENTIFIER}(?:\.{_IDENTIFIER})*")
_ATTRIBUTE_NAME = re.compile(_IDENTIFIER)


def resolve_request_target(
    name: str, pattern: re.Pattern[str], where: str, registered: str = "none"
) -> tuple[str, Any]:
    """A request's qualified name (``pkg.mod.Name`` or ``pkg.mod:Name``) -> ``("pkg.mod:Name",
    the object)``, or an InvalidRequestError naming ``where``.

    The name is request input, so nothing of it is trusted: its dotted form must match
    ``pattern`` whole; it names one module (imported by name, never a file path) and one
    attribute of it (no attribute walk, so ``allowed.module:torch.os.system`` cannot reach
    past the module); and the object must be a class or a function *defined in* that module,
    not one it imported. Only then may it be called (to build the processor)."""
    module_name, sep, attr = name.partition(":")
    if not sep:
        module_name, _, attr = name.rpartition(".")
    if not (_MODULE_NAME.fullmatch(module_name) and _ATTRIBUTE_NAME.fullmatch(attr)):
        raise InvalidRequestError(
            f"{where}: logits processor {name!r} is not a qualified name: give a module and one name "
            "in it, 'package.module.Name' (or 'package.module:Name')",
            param="logits_processors",
        )
    dotted = f"{module_name}.{attr}"
    if not pattern.fullmatch(dotted):
        raise InvalidRequestError(
            f"{where}: logits processor {dotted!r} is not allowed by this server: it is not registered "
            f"(registered: {registered}) and does not match --logits-processor-pattern {pattern.pattern!r} (the whole name must match)",
            param="logits_processors",
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the request's 400: which module, and why
        raise InvalidRequestError(
            f"{where}: logits processor {dotted!r} could not be resolved: cannot import {module_name!r}: "
            f"{type(exc).__name__}: {exc}",
            param="logits_processors",
        ) from None
    target = vars(module).get(attr)
    if not (inspect.isclass(target) or inspect.isfunction(target)) or target.__module__ != module.__name__:
        raise InvalidRequestError(
            f"{where}: logits processor {dotted!r} could not be resolved: module {module_name!r} defines no "
            f"class or function {attr!r}",
            param="logits_processors",
        )
    return f"{module_name}:{attr}", target


class LogitsProcessorResolver:
    """Turns requested processors into specs: a registered name (the operator installed it)
    is always allowed; a qualified name only when the whole of it matches
    ``--logits-processor-pattern`` (unset: none is, as in vLLM), and then only a class or
    function defined in the module it names (:func:`resolve_request_target`)."""

    def __init__(self, registry: Registry | None, pattern: str | None):
        self.registry = registry
        self.pattern = pattern
        self._compiled = re.compile(pattern) if pattern else None

    def resolve(self, requested: Any, param: str = "logits_processors") -> list[LogitsProcessorSpec]:
        """Specs for a request's ``logits_processors`` (strings, or ``{"qualname", "args",
        "kwargs"}`` objects); an InvalidRequestError naming ``param`` for anything not
        allowed, not importable or not constructible."""
        if requested is None:
            return []
        if not isinstance(requested, list):
            raise InvalidRequestError(
                f"{param} must be a list of names or {{qualname, args, kwargs}} objects", param=param
            )
        if len(requested) > MAX_REQUEST_LOGITS_PROCESSORS:
            raise InvalidRequestError(
                f"{param} names {len(requested)} processors; at most {MAX_REQUEST_LOGITS_PROCESSORS} are allowed",
                param=param,
            )
        specs = [self._spec(entry, f"{param}[{index}]") for index, entry in enumerate(requested)]
        for index, spec in enumerate(specs):
            # built once here so a bad name or bad arguments are this request's 400, not a
            # failure in the engine's step; the worker builds its own instance
            try:
                build_processor(spec)
            except Exception as exc:
                raise InvalidRequestError(
                    f"{param}[{index}]: logits processor {spec.name!r} could not be built: {type(exc).__name__}: {exc}",
                    param=param,
                ) from None
        return specs

    def _spec(self, entry: Any, where: str) -> LogitsProcessorSpec:
        args: list[Any]
        kwargs: dict[str, Any]
        if isinstance(entry, str):
            name, args, kwargs, explicit = entry, [], {}, False
        elif isinstance(entry, dict) and isinstance(entry.get("qualname"), str):
            name, args, kwargs, explicit = entry["qualname"], entry.get("args") or [], entry.get("kwargs") or {}, True
            if not isinstance(args, list) or not isinstance(kwargs, dict):
                raise InvalidRequestError(
                    f"{where}: args must be a list and kwargs an object", param="logits_processors"
                )
        else:
            raise InvalidRequestError(
                f'{where} must be a name or an object {{"qualname": ..., "args": [...], "kwargs": {{...}}}}',
                param="logits_processors",
            )
        if self.registry is not None and name in self.registry:
            return LogitsProcessorSpec(name, self.registry.entry(name).target_path, tuple(args), dict(kwargs))
        known = ", ".join(self.registry.names()) if self.registry is not None and len(self.registry) else "none"
        if self._compiled is None:
            raise InvalidRequestError(
                f"{where}: logits processor {name!r} is not registered on this server (registered: {known}), and "
                "qualified names are not allowed: the server was started without --logits-processor-pattern",
                param="logits_processors",
            )
        target_path, target = resolve_request_target(name, self._compiled, where, known)
        return LogitsProcessorSpec(
            name, target_path, tuple(args), dict(kwargs), construct=explicit or inspect.isclass(target)
        )


def resolve_engine_processors(names: list[str] | None, registry: Registry | None) -> list[LogitsProcessorSpec]:
    """``--logits-processors``: each a registered name or an import path (``pkg.mod.Class`` or
    ``pkg.mod:Class``), built with no arguments for every request; a ConfigError naming the
    flag when one cannot be imported or built."""
    specs = []
    for name in names or []:
        registered = registry is not None and name in registry
        target = registry.entry(name).target_path if registry is not None and registered else _qualified_target(name)
        try:
            resolved = resolve_target(target)
            spec = LogitsProcessorSpec(name, target, construct=registered or inspect.isclass(resolved))
            build_processor(spec)
        except Exception as exc:
            raise ConfigError(
                f"--logits-processors: {name!r} is neither a registered logits processor nor an importable, "
                f"constructible one: {type(exc).__name__}: {exc}",
                param="logits-processors",
            ) from None
        specs.append(spec)
    return specs
