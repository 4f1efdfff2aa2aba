"""The built-in tool and reasoning parsers are registered through their entry points in
pyproject.toml, lazily: loading the plugins imports no parser module (and neither torch nor
transformers), and each registered name resolves to a working parser."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tokenloom.builtin_plugins.reasoning_parsers import REASONING_PARSERS
from tokenloom.builtin_plugins.tool_parsers import TOOL_PARSERS

CHECK = textwrap.dedent("""
    import json, sys
    from tokenloom.plugins.manager import load_plugins

    plugin_set = load_plugins()
    report = {}
    for kind in ("tool_parser", "reasoning_parser"):
        registry = plugin_set.registry(kind)
        report[kind] = {entry.name: [entry.plugin_name, isinstance(entry.target, str)] for entry in registry.entries()}
    report["imported"] = sorted(name for name in sys.modules
                                if name.startswith(("tokenloom.builtin_plugins.tool_parsers.",
                                                    "tokenloom.builtin_plugins.reasoning_parsers."))
                                or name in ("torch", "transformers"))
    print(json.dumps(report))
""")


@pytest.fixture(scope="module")
def registration_report():
    env = {key: value for key, value in os.environ.items() if key != "TOKENLOOM_PLUGINS"}
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.hook("register_tool_parsers")
def test_builtin_tool_parsers_are_registered_lazily_by_one_entry_point(registration_report):
    registered = registration_report["tool_parser"]
    assert set(TOOL_PARSERS) <= set(registered)
    assert all(registered[name] == ["builtin_tool_parsers", True] for name in TOOL_PARSERS)
    assert registration_report["imported"] == []


@pytest.mark.hook("register_reasoning_parsers")
def test_builtin_reasoning_parsers_are_registered_lazily_by_one_entry_point(registration_report):
    registered = registration_report["reasoning_parser"]
    assert set(REASONING_PARSERS) <= set(registered)
    assert all(registered[name] == ["builtin_reasoning_parsers", True] for name in REASONING_PARSERS)


def test_every_registered_name_resolves_to_a_parser():
    from tokenloom.core.parsers import ReasoningParser, ToolParser
    from tokenloom.plugins.registry import resolve_target

    for table, package, interface in (
        (TOOL_PARSERS, "tool_parsers", ToolParser),
        (REASONING_PARSERS, "reasoning_parsers", ReasoningParser),
    ):
        for name, target in table.items():
            parser_class = resolve_target(f"tokenloom.builtin_plugins.{package}.{target}")
            assert issubclass(parser_class, interface), name
