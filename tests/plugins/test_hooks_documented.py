"""Every hook in tokenloom/plugins/hookspecs.py has a section in PLUGINS.md and at least one
test marked ``@pytest.mark.hook("register_xxx")`` somewhere under tests/.

A hook section is a level-2 heading naming the hook in backticks (``## `register_models` ...``);
it must name the interface its hook's docstring points at and show a ``@hookimpl`` for it.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pluggy
import pytest

from tokenloom import plugin_api
from tokenloom.plugins import hookspecs

REPO = Path(__file__).resolve().parents[2]
PLUGINS_MD = REPO / "PLUGINS.md"
TESTS = REPO / "tests"


def hook_names() -> list[str]:
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    return [name for name in dir(hookspecs) if manager.parse_hookspec_opts(hookspecs, name) is not None]


def documented_sections() -> dict[str, str]:
    """hook name -> the text of its PLUGINS.md section."""
    sections: dict[str, str] = {}
    parts = re.split(r"^## ", PLUGINS_MD.read_text(encoding="utf-8"), flags=re.MULTILINE)
    for part in parts[1:]:
        heading = part.splitlines()[0]
        for name in re.findall(r"`(register_\w+)`", heading):
            sections[name] = part
    return sections


@functools.cache
def marked_hooks() -> dict[str, list[str]]:
    """hook name -> the tests marked with it (``where::name``), found by reading the test files
    (once: parsing every test file is most of this module's time, and a test per hook asks)."""
    found: dict[str, list[str]] = {}

    def hook_marks(decorators) -> list[str]:
        names = []
        for decorator in decorators:
            if (
                isinstance(decorator, ast.Call)
                and isinstance(decorator.func, ast.Attribute)
                and decorator.func.attr == "hook"
                and isinstance(decorator.func.value, ast.Attribute)
                and decorator.func.value.attr == "mark"
                and decorator.args
                and isinstance(decorator.args[0], ast.Constant)
            ):
                names.append(decorator.args[0].value)
        return names

    for path in TESTS.rglob("test_*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                marks = hook_marks(node.decorator_list)
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                marks = hook_marks(node.decorator_list)
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
                values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
                marks = hook_marks(values)
                node = ast.Name(id="pytestmark")
            else:
                continue
            for name in marks:
                found.setdefault(name, []).append(f"{path.relative_to(REPO)}::{getattr(node, 'name', 'pytestmark')}")
    return found


def test_hookspecs_are_found():
    assert "register_models" in hook_names() and len(hook_names()) >= 10


@pytest.mark.parametrize("hook", hook_names())
def test_every_hook_has_a_section_in_plugins_md(hook):
    sections = documented_sections()
    assert hook in sections, f"PLUGINS.md has no '## `{hook}`' section"
    section = sections[hook]
    assert f"def {hook}(register)" in section and "@hookimpl" in section, (
        f"the {hook} section of PLUGINS.md shows no @hookimpl example"
    )
    interfaces = re.findall(r"tokenloom\.plugin_api\.(\w+)", getattr(hookspecs, hook).__doc__ or "")
    for interface in interfaces:
        assert interface in plugin_api.__all__, f"{hook}'s docstring names {interface}, not in tokenloom.plugin_api"
        assert interface in section, f"the {hook} section of PLUGINS.md does not name its interface {interface}"


def test_plugins_md_documents_no_hook_that_does_not_exist():
    assert set(documented_sections()) <= set(hook_names())


@pytest.mark.parametrize("hook", hook_names())
def test_every_hook_has_a_test(hook):
    tests = marked_hooks().get(hook, [])
    assert tests, f'no test under tests/ is marked @pytest.mark.hook("{hook}")'


def test_hook_markers_name_real_hooks():
    unknown = {name: tests for name, tests in marked_hooks().items() if name not in hook_names()}
    assert not unknown, f"@pytest.mark.hook names hooks that do not exist: {unknown}"


def test_plugins_md_explains_the_hook_marker():
    assert '@pytest.mark.hook("' in PLUGINS_MD.read_text(encoding="utf-8")
