"""Plugin discovery: entry points, ``--plugin MODULE`` and ``--tool-parser-plugin FILE``.

:func:`load_plugins` is the one explicit, idempotent call that discovers plugins, calls
their hooks with an attributed ``register`` callback and returns a :class:`PluginSet`:
a registry per kind, what each plugin registered, and the plugins that failed to load.
Nothing here runs at import time.

A plugin the operator named (``--plugin``, ``--tool-parser-plugin``) that fails is fatal: a
:class:`PluginError` with the cause and the file and line it came from. An installed
entry-point plugin that fails is a warning (listed by ``tokenloom plugins``), fatal too with
``strict`` (``--strict-plugins``).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType
from typing import Any

import importlib_metadata
import pluggy

from tokenloom.errors import PluginError, closest_match
from tokenloom.plugins import hookspecs
from tokenloom.plugins.registry import PlainEntry, Registry, describe_exception, import_file

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tokenloom.plugins"
ENABLED_PLUGINS_ENV = "TOKENLOOM_PLUGINS"


@dataclass(frozen=True)
class PluginKind:
    """One plugin kind: its registry name, the hook that fills it, the flag that picks from it."""

    name: str
    hook: str
    flag: str | None = None


PLUGIN_KINDS: tuple[PluginKind, ...] = (
    PluginKind("platform", "register_platforms", "--device"),
    PluginKind("attention_backend", "register_attention_backends", "--attention-backend"),
    PluginKind("executor", "register_executors", "--distributed-executor-backend"),
    PluginKind("proposer", "register_proposers", "--speculative-config"),
    PluginKind("kv_connector", "register_kv_connectors", "--kv-transfer-config"),
    PluginKind("model", "register_models"),
    PluginKind("load_format", "register_load_formats", "--load-format"),
    PluginKind("quantization", "register_quantization_methods", "--quantization"),
    PluginKind("model_source", "register_model_sources"),
    PluginKind("tool_parser", "register_tool_parsers", "--tool-call-parser"),
    PluginKind("reasoning_parser", "register_reasoning_parsers", "--reasoning-parser"),
    PluginKind("structured_output_backend", "register_structured_output_backends", "--guided-decoding-backend"),
    PluginKind("logits_processor", "register_logits_processors", "--logits-processors"),
    PluginKind("api_route", "register_api_routes"),
)
KIND_BY_NAME = {kind.name: kind for kind in PLUGIN_KINDS}

# Set on a class by the plugin_api decorators (``@register_tool_parser("name")``): a plugin
# file's marked classes are registered when the file is loaded, never at import.
# every registry as plain data: kind -> name -> entry (PluginSet.to_plain)
PlainPlugins = dict[str, dict[str, PlainEntry]]

REGISTRATION_MARK = "__tokenloom_registrations__"


@dataclass
class PluginInfo:
    """A loaded plugin: where it came from and what it registered, by kind."""

    name: str
    origin: str  # "package 1.2.3", "module foo.bar" or "file /path/x.py"
    registered: dict[str, list[str]] = field(default_factory=dict)
    hooks: list[str] = field(default_factory=list)  # the hooks it implements, in call order

    def nothing_registered_reason(self) -> str:
        """Why a plugin that loaded registered nothing, for ``tokenloom plugins``."""
        if self.hooks:
            return f"its hooks ({', '.join(self.hooks)}) ran and called register for nothing"
        return 'it implements no hook (functions marked @hookimpl) and marks no class (@register_tool_parser("name"))'


@dataclass
class PluginFailure:
    """A plugin that could not be loaded, with the cause (the others still load)."""

    name: str
    origin: str
    cause: str


@dataclass
class PluginSet:
    """Everything plugins registered: one :class:`Registry` per kind."""

    registries: dict[str, Registry]
    plugins: list[PluginInfo]
    failures: list[PluginFailure]

    def registry(self, kind: str) -> Registry:
        return self.registries[kind]

    def to_plain(self) -> PlainPlugins:
        """Registries as plain data for worker processes and data-parallel replicas (they never
        re-run discovery)."""
        return {kind: registry.to_plain() for kind, registry in self.registries.items()}

    @classmethod
    def from_plain(cls, tables: PlainPlugins) -> PluginSet:
        registries = {
            kind.name: Registry.from_plain(kind.name, tables.get(kind.name, {}), kind.flag) for kind in PLUGIN_KINDS
        }
        return cls(registries, [], [])


def new_registries() -> dict[str, Registry]:
    return {kind.name: Registry(kind.name, kind.flag) for kind in PLUGIN_KINDS}


def enabled_entry_point_names() -> set[str] | None:
    """``TOKENLOOM_PLUGINS=a,b`` restricts which entry-point plugins load; unset means all."""
    value = os.environ.get(ENABLED_PLUGINS_ENV)
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


# (modules, files, entry_points, enabled) -> the PluginSet they load
_cache: dict[tuple[object, ...], PluginSet] = {}
_cache_lock = threading.Lock()


def load_plugins(
    modules: Iterable[str] = (),
    files: Iterable[str] = (),
    *,
    entry_points: bool = True,
    strict: bool = False,
) -> PluginSet:
    """Discover and load plugins; the same arguments (and environment) give the same PluginSet.

    :param modules: importable module names given with ``--plugin``; one that fails to load
        raises :class:`PluginError` (naming the module, the cause, its file and line), since
        the operator asked for it by name.
    :param files: ``.py`` paths given with ``--tool-parser-plugin``; likewise.
    :param entry_points: load the ``tokenloom.plugins`` entry-point group (the built-ins too).
    :param strict: an entry-point plugin that fails raises too (``--strict-plugins``), instead
        of being left out with a warning.
    """
    # materialised once: a generator would be empty the second time it is read
    modules = list(modules)
    files = list(files)
    enabled = enabled_entry_point_names()
    key = (
        tuple(modules),
        tuple(os.path.abspath(f) for f in files),
        entry_points,
        tuple(sorted(enabled)) if enabled is not None else None,
    )
    with _cache_lock:
        if key not in _cache:
            _cache[key] = _load(modules, files, entry_points, enabled)
        plugin_set = _cache[key]
    if strict and plugin_set.failures:
        raise PluginError(
            "--strict-plugins: "
            + "; ".join(
                f"plugin {failure.name!r} ({failure.origin}) failed to load: {failure.cause}"
                for failure in plugin_set.failures
            )
        )
    return plugin_set


def _load(modules: list[str], files: list[str], entry_points: bool, enabled: set[str] | None) -> PluginSet:
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    registries = new_registries()
    plugins: list[PluginInfo] = []
    failures: list[PluginFailure] = []

    def fail(name: str, origin: str, cause: str) -> None:
        logger.warning("plugin %r (%s) failed to load: %s", name, origin, cause)
        failures.append(PluginFailure(name, origin, cause))

    def add(name: str, origin: str, load: Callable[[], ModuleType]) -> None:
        try:
            module = load()
        except Exception as exc:
            fail(name, origin, describe_exception(exc))
            return
        if manager.is_registered(module):
            return  # e.g. --plugin naming a module an entry point already loaded
        if manager.has_plugin(name):
            fail(name, origin, f"another plugin is already loaded under the name {name!r}; rename one of them")
            return
        unknown = _unknown_hooks(manager, module) or _unmarked_hooks(manager, module)
        if unknown:
            fail(name, origin, unknown)
            return
        try:
            manager.register(module, name=name)
        except Exception as exc:  # pluggy rejects hook functions with wrong argument names
            fail(name, origin, f"{type(exc).__name__}: {exc}")
            return
        info = PluginInfo(name, origin)
        staged = {kind: registry.copy() for kind, registry in registries.items()}
        cause = _call_hooks(manager, module, info, staged)
        if cause is not None:
            manager.unregister(module)
            fail(name, origin, cause)
            return
        registries.update(staged)
        plugins.append(info)

    if entry_points:
        discovered = sorted(importlib_metadata.entry_points(group=ENTRY_POINT_GROUP), key=_builtin_first)
        if enabled is not None:
            for missing in sorted(enabled - {entry_point.name for entry_point in discovered}):
                fail(
                    missing,
                    ENABLED_PLUGINS_ENV,
                    f"{ENABLED_PLUGINS_ENV} names {missing!r} but no installed plugin has that name; installed: "
                    + ", ".join(sorted({entry_point.name for entry_point in discovered})),
                )
        for entry_point in discovered:
            if enabled is not None and entry_point.name not in enabled:
                continue
            dist = entry_point.dist
            origin = f"{dist.name} {dist.version}" if dist is not None else f"module {entry_point.value}"
            add(entry_point.name, origin, entry_point.load)
    for module_name in modules:
        add(module_name, f"module {module_name}", partial(importlib.import_module, module_name))
        if failures and failures[-1].origin == f"module {module_name}":
            raise PluginError(f"--plugin {module_name}: {failures[-1].cause}")
    for path in files:
        try:
            module = import_file(path)
        except Exception as exc:
            raise PluginError(f"--tool-parser-plugin {path}: {describe_exception(exc)}") from exc
        add(os.path.basename(path), f"file {os.path.abspath(path)}", partial(_loaded, module))
        if failures and failures[-1].origin == f"file {os.path.abspath(path)}":
            raise PluginError(f"--tool-parser-plugin {path}: {failures[-1].cause}")
    return PluginSet(registries, plugins, failures)


def _loaded(module: ModuleType) -> ModuleType:
    return module


def _builtin_first(entry_point: importlib_metadata.EntryPoint) -> tuple[int, str]:
    # Built-ins register first so that `auto` choices (load format, model source, platform)
    # try them in a fixed order; a third-party plugin replaces one with override=True.
    return (0 if entry_point.value.startswith("tokenloom.") else 1, entry_point.name)


def _unknown_hooks(manager: pluggy.PluginManager, module: ModuleType) -> str | None:
    """A misspelt hook (``register_model``) would silently never be called: name it instead."""
    known = [kind.hook for kind in PLUGIN_KINDS]
    for attr in dir(module):
        if attr in known or manager.parse_hookimpl_opts(module, attr) is None:
            continue
        suggestion = closest_match(attr, known)
        return f"{attr!r} is marked @hookimpl but is not a tokenloom hook" + (
            f"; did you mean {suggestion!r}?" if suggestion else f"; hooks: {', '.join(known)}"
        )
    return None


def _unmarked_hooks(manager: pluggy.PluginManager, module: ModuleType) -> str | None:
    """A hook function without ``@hookimpl`` is never called, and the plugin would register
    nothing without a word: name it instead."""
    known = [kind.hook for kind in PLUGIN_KINDS]
    for attr, value in vars(module).items():
        if not inspect.isfunction(value) or value.__module__ != module.__name__:
            continue
        if manager.parse_hookimpl_opts(module, attr) is not None:
            continue
        # the exact name, or a near miss (register_tool_parser); not any helper named register_*
        near = difflib.get_close_matches(attr, known, n=1, cutoff=0.85)
        hook = attr if attr in known else near[0] if near else None
        if hook is not None:
            return (
                f"{attr!r} looks like the {hook} hook but is not marked: decorate it with @hookimpl "
                "(from tokenloom.plugin_api import hookimpl)" + (f" and name it {hook!r}" if attr != hook else "")
            )
    return None


def _call_hooks(
    manager: pluggy.PluginManager, module: ModuleType, info: PluginInfo, registries: dict[str, Registry]
) -> str | None:
    """Call the plugin's hooks (and register its marked classes) into ``registries``; the
    cause of the first failure, or None."""
    for kind in PLUGIN_KINDS:
        registry = registries[kind.name]

        def register(
            name: str,
            target: Any,
            *,
            override: bool = False,
            _registry: Registry = registry,
            _kind: str = kind.name,
            **options: Any,
        ) -> None:
            _registry.register(name, target, plugin_name=info.name, override=override, **options)
            info.registered.setdefault(_kind, []).append(name)

        hook = getattr(manager.hook, kind.hook)
        for impl in hook.get_hookimpls():
            if impl.plugin is not module:
                continue
            info.hooks.append(kind.hook)
            try:
                impl.function(register=register)
            except Exception as exc:
                return f"{kind.hook} raised {describe_exception(exc)}"
    for value in list(vars(module).values()):
        # the class's own marks only: a subclass of a marked class is not registered again
        marks = vars(value).get(REGISTRATION_MARK, ()) if isinstance(value, type) else ()
        for kind_name, name, options in marks:
            if value.__module__ != module.__name__:
                continue  # imported from elsewhere: registered by its own module
            try:
                registries[kind_name].register(name, value, plugin_name=info.name, **options)
            except Exception as exc:
                return f"registering {value.__qualname__} raised {type(exc).__name__}: {exc}"
            info.registered.setdefault(kind_name, []).append(name)
    return None
