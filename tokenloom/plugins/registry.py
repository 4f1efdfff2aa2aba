"""Typed, named registries: one per plugin kind, filled through the hooks' ``register`` callback.

A registry maps a name to a target (a class, a factory, or a lazy ``"module:attr"`` string)
and remembers which plugin registered it. Lookups of an unknown name list the known names
and the closest match; a duplicate name is an error naming both plugins.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TypedDict

from tokenloom.errors import PluginError, UnknownNameError, closest_match

# ``closest_match`` lives in tokenloom.errors (which imports nothing of tokenloom's); kept
# importable from here for the modules that look it up here
__all__ = [
    "PlainEntry",
    "Registry",
    "RegistryEntry",
    "closest_match",
    "describe_exception",
    "import_file",
    "resolve_target",
]


@dataclass
class RegistryEntry:
    """One registered name: what it points at and who registered it."""

    name: str
    target: Any
    plugin_name: str
    options: dict[str, Any] = field(default_factory=dict)
    kind: str = ""  # the registry's kind, named in errors
    _resolved: Any = None

    @property
    def target_path(self) -> str:
        """The target as plain data (``"module:attr"``), what worker processes receive."""
        if isinstance(self.target, str):
            return self.target
        module = getattr(self.target, "__module__", None)
        qualname = getattr(self.target, "__qualname__", None)
        source_file = getattr(sys.modules.get(module or ""), "__file__", None)
        if module and module.startswith("_tokenloom_file_plugin_") and source_file:
            return f"{source_file}:{qualname}"
        return f"{module}:{qualname}"

    def resolve(self) -> Any:
        """The target, imported on first use; a PluginError names the kind, the name and the
        plugin that registered it."""
        if self._resolved is None:
            try:
                self._resolved = resolve_target(self.target) if isinstance(self.target, str) else self.target
            except PluginError as exc:
                raise PluginError(
                    f"{self.kind or 'plugin'} {self.name!r} (registered by plugin {self.plugin_name!r}): {exc}"
                ) from exc
        return self._resolved


# frames of the code that imports plugins and registers their classes, not the plugins'
_LOADING_MACHINERY = (
    "<frozen",
    os.path.dirname(__file__) + os.sep,
    os.path.join(os.path.dirname(os.path.dirname(__file__)), "plugin_api.py"),
)


def describe_exception(exc: BaseException) -> str:
    """``Type: message (at FILE:LINE)``: the line of the plugin's own code that failed (the
    outermost frame outside importlib's machinery and this module), and where the error was
    finally raised when that is elsewhere (a library the plugin called). A SyntaxError names
    its own line."""
    if isinstance(exc, SyntaxError) and exc.filename:
        places = [f"{exc.filename}:{exc.lineno}"]
    else:
        places = [
            f"{frame.filename}:{frame.lineno}"
            for frame in traceback.extract_tb(exc.__traceback__)
            if not frame.filename.startswith(_LOADING_MACHINERY)
            and "/importlib/" not in frame.filename
            and "/importlib_metadata/" not in frame.filename
        ]
    where = ""
    if places:
        where = f" (at {places[0]}" + (f", raised in {places[-1]}" if len(places) > 1 else "") + ")"
    return f"{type(exc).__name__}: {exc}{where}"


def resolve_target(path: str) -> Any:
    """Import ``"package.module:attr"`` (or ``"/path/file.py:attr"``) and return ``attr``."""
    module_name, sep, attr_path = path.rpartition(":")
    if not sep or not module_name or not attr_path:
        raise PluginError(f"plugin target {path!r} is not of the form 'module:attr'")
    if "<locals>" in attr_path:
        # what a class defined inside a function becomes as plain data
        raise PluginError(
            f"plugin target {path!r} cannot be imported by name (it was defined inside a function); "
            "define it at module level of an importable module"
        )
    try:
        if module_name.endswith(".py"):
            module = import_file(module_name)
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:  # report which target failed, and why
        raise PluginError(f"cannot import plugin target {path!r}: {describe_exception(exc)}") from exc
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(
                f"plugin target {path!r}: module {module_name!r} has no attribute {attr_path!r}"
            ) from None
    return obj


def import_file(path: str) -> ModuleType:
    """Import a .py file by path under a private module name (once per path)."""
    resolved = Path(path).resolve()
    module_name = "_tokenloom_file_plugin_" + "".join(c if c.isalnum() else "_" for c in str(resolved))
    if module_name in sys.modules:
        return sys.modules[module_name]
    if not resolved.is_file():
        raise FileNotFoundError(f"no such plugin file: {path}")
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path} as a Python module (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


class PlainEntry(TypedDict):
    """A registry entry as plain data (JSON- and pickle-safe), what crosses to other processes."""

    target: str
    plugin: str
    options: dict[str, Any]


class Registry:
    """Name -> target for one plugin kind (``kind`` is e.g. ``"tool_parser"``)."""

    def __init__(self, kind: str, flag: str | None = None):
        self.kind = kind
        # the CLI flag that chooses from this registry, named in error messages
        self.flag = flag
        self._entries: dict[str, RegistryEntry] = {}

    def register(self, name: str, target: Any, *, plugin_name: str, override: bool = False, **options: Any) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {plugin_name!r} registered a {self.kind} with an invalid name {name!r}")
        if not (isinstance(target, str) or callable(target)):
            raise PluginError(
                f"plugin {plugin_name!r} registered {self.kind} {name!r} with target {target!r}: "
                "expected a class, a callable or a 'module:attr' string"
            )
        existing = self._entries.get(name)
        if existing is not None and not override:
            raise PluginError(
                f"{self.kind} {name!r} is registered twice: by plugin {existing.plugin_name!r} and by "
                f"plugin {plugin_name!r}; rename one, or pass override=True to replace it deliberately"
            )
        self._entries[name] = RegistryEntry(name, target, plugin_name, options, kind=self.kind)

    def copy(self) -> Registry:
        """A shallow copy: the manager registers a plugin into a copy and keeps it only when
        every hook of that plugin succeeded, so a failed plugin leaves nothing behind."""
        duplicate = Registry(self.kind, self.flag)
        duplicate._entries = dict(self._entries)
        return duplicate

    def names(self) -> list[str]:
        return list(self._entries)

    def entries(self) -> list[RegistryEntry]:
        return list(self._entries.values())

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, name: str) -> RegistryEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(self.kind, name, self.names(), flag=self.flag) from None

    def get(self, name: str) -> Any:
        """The resolved target (imported on first use)."""
        return self.entry(name).resolve()

    def to_plain(self) -> dict[str, PlainEntry]:
        """Plain data for worker processes and replicas: name -> the target as ``"module:attr"``,
        the plugin that registered it (named in their errors) and its options. The order is
        kept: ``auto`` choices depend on it."""
        return {
            name: {"target": entry.target_path, "plugin": entry.plugin_name, "options": dict(entry.options)}
            for name, entry in self._entries.items()
        }

    @classmethod
    def from_plain(cls, kind: str, table: dict[str, PlainEntry], flag: str | None = None) -> Registry:
        registry = cls(kind, flag)
        for name, plain in table.items():
            registry.register(name, plain["target"], plugin_name=plain["plugin"], **plain["options"])
        return registry
