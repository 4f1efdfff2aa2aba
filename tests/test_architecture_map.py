"""ARCHITECTURE.md stays true to the code: every file and ``path:Name`` it cites exists, every
``Class.member`` it names is a member of a class by that name, every hook has a row in its
"Where to add" table, the README and docs/design.md point to it, and the package's imports
follow its layers except for the exceptions it lists (:data:`KNOWN_EXCEPTIONS`, the same list).

A failure here means the map or the code moved: fix the reference, or, for a new import that
crosses a layer, either move the code or add the import to the map's known exceptions and here.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pluggy

from tokenloom.plugins import hookspecs

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "tokenloom"
MAP = REPO / "ARCHITECTURE.md"
# a cited path is from the repository root, from tokenloom/, or (the core table) from tokenloom/core/
BASES = (REPO, PACKAGE, PACKAGE / "core")

CODE_SPAN = re.compile(r"`([^`\n]+)`")
FILE_REFERENCE = re.compile(r"^([\w./-]+\.py):([A-Za-z_][\w.]*)$")
TEST_REFERENCE = re.compile(r"^(tests/[\w./-]+\.py)::(\w+)$")
PATH = re.compile(r"^[\w.-]+(/[\w.-]*)*$")
PATH_SUFFIXES = (".py", ".md", ".toml", "/")
CLASS_MEMBER = re.compile(r"^(_?[A-Z]\w*)\.(\w+)$")


def code_spans() -> list[str]:
    return CODE_SPAN.findall(MAP.read_text(encoding="utf-8"))


def find(path: str) -> Path | None:
    for base in BASES:
        candidate = base / path
        if candidate.exists():
            return candidate
    return None


@functools.cache
def module_tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def members(node: ast.Module | ast.ClassDef) -> dict[str, ast.AST]:
    """The names a module or class body defines: functions, classes, assignments."""
    found: dict[str, ast.AST] = {}
    for child in node.body:
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[child.name] = child
        elif isinstance(child, ast.Assign):
            for target in child.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = child
        elif isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name):
            found[child.target.id] = child
    return found


def defines(path: Path, dotted: str) -> bool:
    node: ast.AST = module_tree(path)
    for part in dotted.split("."):
        if not isinstance(node, (ast.Module, ast.ClassDef)) or part not in members(node):
            return False
        node = members(node)[part]
    return True


@functools.cache
def class_members() -> dict[str, set[str]]:
    """Class name -> the members of every class so named in the package (bases included)."""
    classes: dict[str, list[ast.ClassDef]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(module_tree(path)):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(node)

    def collect(name: str, seen: frozenset[str]) -> set[str]:
        names: set[str] = set()
        for node in classes.get(name, []):
            names |= set(members(node))
            for base in node.bases:
                base_name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                if base_name in classes and base_name not in seen:
                    names |= collect(base_name, seen | {base_name})
        return names

    return {name: collect(name, frozenset({name})) for name in classes}


def test_every_cited_file_and_definition_exists():
    missing = []
    for span in code_spans():
        file_reference = FILE_REFERENCE.match(span)
        test_reference = TEST_REFERENCE.match(span)
        if file_reference or test_reference:
            path_text, name = (file_reference or test_reference).groups()
            path = find(path_text)
            if path is None:
                missing.append(f"{span}: no file {path_text}")
            elif not defines(path, name):
                missing.append(f"{span}: {path.relative_to(REPO)} defines no {name}")
        elif PATH.match(span) and span.endswith(PATH_SUFFIXES) and "/" in span.rstrip("/"):
            if find(span) is None:
                missing.append(f"{span}: no such file or directory")
    assert not missing, "ARCHITECTURE.md cites what is not there:\n" + "\n".join(missing)


def test_every_cited_class_member_exists():
    known = class_members()
    missing = [
        span
        for span in code_spans()
        if (match := CLASS_MEMBER.match(span)) and match[1] in known and match[2] not in known[match[1]]
    ]
    unknown_classes = [span for span in code_spans() if (match := CLASS_MEMBER.match(span)) and match[1] not in known]
    assert not missing, f"ARCHITECTURE.md names members its classes do not have: {missing}"
    assert not unknown_classes, f"ARCHITECTURE.md names classes the package does not have: {unknown_classes}"


def test_the_checks_catch_a_wrong_reference():
    scheduler = find("core/scheduler.py")
    assert scheduler is not None and defines(scheduler, "Scheduler.schedule")
    assert not defines(scheduler, "Scheduler.no_such_method")
    assert "schedule" in class_members()["Scheduler"] and "step" not in class_members()["Scheduler"]
    assert "execute_async" in class_members()["UniProcExecutor"]  # inherited from Executor
    assert find("core/no_such_module.py") is None


def test_every_hook_has_a_row_in_where_to_add():
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    hooks = [name for name in dir(hookspecs) if manager.parse_hookspec_opts(hookspecs, name) is not None]
    table = MAP.read_text(encoding="utf-8").split("## Where to add", 1)[1].split("\n## ", 1)[0]
    assert hooks and not [hook for hook in hooks if f"`{hook}`" not in table]


def test_readme_and_design_point_to_the_map():
    assert "](ARCHITECTURE.md)" in (REPO / "README.md").read_text(encoding="utf-8")
    assert "](../ARCHITECTURE.md)" in (REPO / "docs" / "design.md").read_text(encoding="utf-8")


# -- the layers ---------------------------------------------------------------------------------

# layer -> the layers it may import (a layer is tokenloom's top-level package or module)
ALLOWED_IMPORTS: dict[str, set[str]] = {
    "errors": set(),
    "kernels": {"errors"},
    "layers": {"errors", "kernels"},
    "plugins": {"errors"},
    "core": {"errors", "plugins"},
    "lora": {"errors", "layers", "kernels"},
    "models": {"errors", "core", "layers", "kernels"},
    "model_api": {"errors", "core", "layers", "models"},
    "chat_template": {"errors"},
    "parsing": {"errors", "core"},
    # layers: the quantization interface (QuantizationConfig, QuantizationMethod) lives beside
    # the linear layers that call it, and plugin_api re-exports it lazily
    "plugin_api": {"errors", "plugins", "core", "parsing", "layers"},
    "worker_api": {"errors", "plugins", "core"},
    "plugin_testing": {"errors", "plugins", "core", "plugin_api"},
    "builtin_plugins": {"errors", "plugin_api", "model_api", "worker_api", "layers", "kernels"},
    "llm": {"errors", "plugins", "core", "chat_template", "lora"},
    "api": {"errors", "plugins", "core", "chat_template", "lora", "llm", "__init__"},
    "__main__": {"api"},
    "ray_serve": {"errors", "plugins", "core", "api"},
    "__init__": set(),
}

# (importing file or directory, imported module prefix): ARCHITECTURE.md's known exceptions
KNOWN_EXCEPTIONS: tuple[tuple[str, str], ...] = (
    ("plugin_api.py", "tokenloom.api.protocol"),
    ("core/engine/llm_engine.py", "tokenloom.lora.catalog"),
    ("core/model_runner.py", "tokenloom.lora.manager"),
    ("api/cli.py", "tokenloom.kernels.cpu_native"),
)


def layer_of_module(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of_file(relative: str) -> str:
    first = relative.split("/")[0]
    return first.removesuffix(".py")


def tokenloom_imports(path: Path) -> list[str]:
    """Every tokenloom module ``path`` imports, at any depth (lazy imports too)."""
    imported = []
    for node in ast.walk(module_tree(path)):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.append(node.module)
    return [name for name in imported if name == "tokenloom" or name.startswith("tokenloom.")]


def layer_violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        source = layer_of_file(relative)
        for module in tokenloom_imports(path):
            target = layer_of_module(module)
            if target == source or target in ALLOWED_IMPORTS[source]:
                continue
            if any(relative.startswith(where) and module.startswith(prefix) for where, prefix in KNOWN_EXCEPTIONS):
                continue
            found.append(f"tokenloom/{relative} imports {module} ({source} -> {target})")
    return found


def test_imports_follow_the_layers_except_the_known_exceptions():
    violations = layer_violations()
    assert not violations, (
        "imports that cross ARCHITECTURE.md's layers (move the code, or list the import among the "
        "map's known exceptions and in KNOWN_EXCEPTIONS):\n" + "\n".join(violations)
    )


# the built-in models are written as a third party's: their only tokenloom imports are the two
# public modules and each other
MODEL_PLUGIN_IMPORTS = ("tokenloom.plugin_api", "tokenloom.model_api", "tokenloom.builtin_plugins.models")


def test_built_in_models_import_only_the_public_modules():
    models = sorted((PACKAGE / "builtin_plugins" / "models").rglob("*.py"))
    assert len(models) > 5
    private = [
        f"{path.relative_to(REPO)} imports {module}"
        for path in models
        for module in tokenloom_imports(path)
        if not (module in MODEL_PLUGIN_IMPORTS or module.startswith("tokenloom.builtin_plugins.models."))
    ]
    assert not private, (
        "a model plugin imports from tokenloom.model_api (layers) or tokenloom.plugin_api (hooks):\n"
        + "\n".join(private)
    )


def plugin_api_names_from(imported_prefix: str) -> set[str]:
    """The names ``plugin_api`` re-exports from modules under ``imported_prefix``."""
    from tokenloom import plugin_api

    return {name for name, module in plugin_api._LAZY.items() if module.startswith(imported_prefix)}


def test_built_in_plugins_reach_the_server_layer_through_no_public_name():
    """``plugin_api`` re-exports the server's ``ChatCompletionRequest`` for third-party parsers
    written against it, but the built-ins (and ``parsing``, what they are built from) type a
    request as ``ParserRequest``: none of them depends on ``tokenloom.api``, even for types."""
    server_names = plugin_api_names_from("tokenloom.api")
    assert server_names == {"ChatCompletionRequest"}
    found = []
    for directory in ("builtin_plugins", "parsing"):
        for path in sorted((PACKAGE / directory).rglob("*.py")):
            for node in ast.walk(module_tree(path)):
                if isinstance(node, ast.ImportFrom) and node.module == "tokenloom.plugin_api":
                    found += [
                        f"{path.relative_to(REPO)} imports {alias.name} from tokenloom.plugin_api"
                        for alias in node.names
                        if alias.name in server_names
                    ]
    assert not found, "type the request as tokenloom.plugin_api.ParserRequest:\n" + "\n".join(found)


def test_every_known_exception_is_still_taken():
    """An exception the code no longer needs is taken off the map and this list."""
    taken = set()
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        for module in tokenloom_imports(path):
            for where, prefix in KNOWN_EXCEPTIONS:
                if relative.startswith(where) and module.startswith(prefix):
                    taken.add((where, prefix))
    assert set(KNOWN_EXCEPTIONS) <= taken, sorted(set(KNOWN_EXCEPTIONS) - taken)
