"""Plugin discovery: entry points (real distribution metadata written to a temporary
directory), TOKENLOOM_PLUGINS, --plugin MODULE, --tool-parser-plugin FILE, failures that
leave the other plugins loaded, and the built-ins registered through the real entry points."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from tokenloom.errors import PluginError
from tokenloom.plugins import manager
from tokenloom.plugins.manager import ENABLED_PLUGINS_ENV, load_plugins


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A directory on sys.path where tests write plugin modules and their distributions."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(manager, "_cache", {})  # discovery must see this test's sys.path
    monkeypatch.delenv(ENABLED_PLUGINS_ENV, raising=False)
    created: list[str] = []

    def write_module(name: str, source: str) -> str:
        path = tmp_path / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        monkeypatch.delitem(sys.modules, name, raising=False)  # also removed again at teardown
        created.append(name)
        return str(path)

    def write_distribution(dist_name: str, version: str, entry_points: dict[str, str]) -> None:
        info = tmp_path / f"{dist_name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(
            "[tokenloom.plugins]\n" + "".join(f"{name} = {module}\n" for name, module in entry_points.items())
        )

    write_module.distribution = write_distribution
    write_module.directory = tmp_path
    return write_module


def only_entry_points(monkeypatch, *names: str) -> None:
    """Restrict discovery to these entry points (keeps the built-ins out of a unit test)."""
    monkeypatch.setenv(ENABLED_PLUGINS_ENV, ",".join(names))


ALPHA = """
    from tokenloom.plugin_api import hookimpl

    @hookimpl
    def register_tool_parsers(register):
        register("shared", "json:JSONDecoder")

    @hookimpl
    def register_reasoning_parsers(register):
        register("alpha_reasoning", "json:JSONEncoder")
"""


def test_an_entry_point_plugin_is_discovered_with_its_package_and_version(plugin_dir, monkeypatch):
    plugin_dir("dummy_alpha", ALPHA)
    plugin_dir.distribution("dummy-alpha", "1.2.3", {"alpha": "dummy_alpha"})
    only_entry_points(monkeypatch, "alpha")
    plugin_set = load_plugins()
    [info] = plugin_set.plugins
    assert (info.name, info.origin) == ("alpha", "dummy-alpha 1.2.3")
    assert info.registered == {"tool_parser": ["shared"], "reasoning_parser": ["alpha_reasoning"]}
    assert plugin_set.registry("tool_parser").get("shared") is json.JSONDecoder
    assert plugin_set.registry("tool_parser").entry("shared").plugin_name == "alpha"
    assert plugin_set.failures == []


def test_tokenloom_plugins_restricts_entry_points_and_reports_unknown_names(plugin_dir, monkeypatch):
    plugin_dir("dummy_alpha", ALPHA)
    plugin_dir(
        "dummy_gamma",
        """
        from tokenloom.plugin_api import hookimpl

        @hookimpl
        def register_models(register):
            register("GammaForCausalLM", "json:JSONDecoder")
    """,
    )
    plugin_dir.distribution("dummy-alpha", "1.0", {"alpha": "dummy_alpha"})
    plugin_dir.distribution("dummy-gamma", "1.0", {"gamma": "dummy_gamma"})
    only_entry_points(monkeypatch, "gamma", "typo_plugin")
    plugin_set = load_plugins()
    assert [info.name for info in plugin_set.plugins] == ["gamma"]
    assert "dummy_alpha" not in sys.modules  # a plugin left out is not even imported
    [failure] = plugin_set.failures
    assert failure.name == "typo_plugin" and failure.origin == ENABLED_PLUGINS_ENV
    assert "no installed plugin has that name" in failure.cause and "alpha" in failure.cause


def test_duplicate_names_across_plugins_fail_the_second_naming_both_and_keep_nothing_of_it(plugin_dir, monkeypatch):
    plugin_dir("dummy_alpha", ALPHA)
    plugin_dir(
        "dummy_beta",
        """
        from tokenloom.plugin_api import hookimpl

        @hookimpl
        def register_reasoning_parsers(register):
            register("beta_reasoning", "json:JSONEncoder")

        @hookimpl
        def register_tool_parsers(register):
            register("shared", "json:JSONEncoder")
    """,
    )
    plugin_dir.distribution("dummy-alpha", "1.0", {"alpha": "dummy_alpha"})
    plugin_dir.distribution("dummy-beta", "1.0", {"beta": "dummy_beta"})
    only_entry_points(monkeypatch, "alpha", "beta")
    plugin_set = load_plugins()
    assert [info.name for info in plugin_set.plugins] == ["alpha"]
    [failure] = plugin_set.failures
    assert failure.name == "beta" and failure.origin == "dummy-beta 1.0"
    assert "'shared' is registered twice" in failure.cause
    assert "'alpha'" in failure.cause and "'beta'" in failure.cause
    assert plugin_set.registry("tool_parser").get("shared") is json.JSONDecoder
    # the failed plugin's other registrations are rolled back
    assert "beta_reasoning" not in plugin_set.registry("reasoning_parser")


def test_override_replaces_a_name_another_plugin_registered(plugin_dir, monkeypatch):
    plugin_dir("dummy_alpha", ALPHA)
    plugin_dir(
        "dummy_beta",
        """
        from tokenloom.plugin_api import hookimpl

        @hookimpl
        def register_tool_parsers(register):
            register("shared", "json:JSONEncoder", override=True)
    """,
    )
    plugin_dir.distribution("dummy-alpha", "1.0", {"alpha": "dummy_alpha"})
    plugin_dir.distribution("dummy-beta", "1.0", {"beta": "dummy_beta"})
    only_entry_points(monkeypatch, "alpha", "beta")
    plugin_set = load_plugins()
    assert plugin_set.failures == []
    assert plugin_set.registry("tool_parser").get("shared") is json.JSONEncoder
    assert plugin_set.registry("tool_parser").entry("shared").plugin_name == "beta"


def test_a_plugin_that_fails_to_import_is_reported_and_the_others_load(plugin_dir, monkeypatch):
    plugin_dir("dummy_alpha", ALPHA)
    plugin_dir(
        "dummy_broken",
        """
        raise ImportError("dummy_broken needs libfoo, which is not installed")
    """,
    )
    plugin_dir.distribution("dummy-alpha", "1.0", {"alpha": "dummy_alpha"})
    plugin_dir.distribution("dummy-broken", "0.1", {"broken": "dummy_broken"})
    only_entry_points(monkeypatch, "alpha", "broken")
    plugin_set = load_plugins()
    assert [info.name for info in plugin_set.plugins] == ["alpha"]
    [failure] = plugin_set.failures
    assert (failure.name, failure.origin) == ("broken", "dummy-broken 0.1")
    # the cause says where: the file and line of the plugin's own code that raised
    assert failure.cause == (
        "ImportError: dummy_broken needs libfoo, which is not installed "
        f"(at {plugin_dir.directory / 'dummy_broken.py'}:2)"
    )


def test_strict_makes_a_failing_entry_point_plugin_fatal(plugin_dir, monkeypatch):
    plugin_dir("dummy_alpha", ALPHA)
    plugin_dir(
        "dummy_broken",
        """
        import json
        json.loads("{")
    """,
    )
    plugin_dir.distribution("dummy-alpha", "1.0", {"alpha": "dummy_alpha"})
    plugin_dir.distribution("dummy-broken", "0.1", {"broken": "dummy_broken"})
    only_entry_points(monkeypatch, "alpha", "broken")
    assert [failure.name for failure in load_plugins().failures] == ["broken"]  # a warning by default
    with pytest.raises(PluginError) as caught:
        load_plugins(strict=True)
    message = str(caught.value)
    assert message.startswith("--strict-plugins: plugin 'broken' (dummy-broken 0.1) failed to load: JSONDecodeError")
    # the plugin's line first, then where the library it called raised
    assert f"(at {plugin_dir.directory / 'dummy_broken.py'}:3, raised in " in message
    assert message.endswith("json/decoder.py:" + message.rsplit(":", 1)[1])


def test_a_hook_without_hookimpl_fails_saying_what_was_meant(plugin_dir, monkeypatch):
    plugin_dir(
        "dummy_unmarked",
        """
        def register_tool_parsers(register):
            register("never", "json:JSONDecoder")

        def register_everything_else():  # a helper, not a hook
            pass
    """,
    )
    plugin_dir(
        "dummy_unmarked_typo",
        """
        def register_tool_parser(register):
            register("never", "json:JSONDecoder")
    """,
    )
    plugin_dir.distribution("dummy-unmarked", "1.0", {"unmarked": "dummy_unmarked", "typo": "dummy_unmarked_typo"})
    only_entry_points(monkeypatch, "unmarked", "typo")
    plugin_set = load_plugins()
    assert plugin_set.plugins == []
    causes = {failure.name: failure.cause for failure in plugin_set.failures}
    assert causes["unmarked"] == (
        "'register_tool_parsers' looks like the register_tool_parsers hook but is not marked: "
        "decorate it with @hookimpl (from tokenloom.plugin_api import hookimpl)"
    )
    assert causes["typo"].endswith(
        "@hookimpl (from tokenloom.plugin_api import hookimpl) and name it 'register_tool_parsers'"
    )


def test_register_tool_parser_without_a_name_fails_saying_so(plugin_dir, tmp_path):
    path = tmp_path / "nameless_parser.py"
    path.write_text(
        textwrap.dedent("""
        from tokenloom.plugin_api import ToolParser, register_tool_parser

        @register_tool_parser
        class NamelessParser(ToolParser):
            pass
    """)
    )
    with pytest.raises(PluginError) as caught:
        load_plugins(files=[str(path)], entry_points=False)
    assert (
        "TypeError: @register_tool_parser(name) needs the name the flag will choose, e.g. "
        '@register_tool_parser("my_tool_parser"); it got the class NamelessParser'
    ) in str(caught.value)
    assert f"(at {path}:4)" in str(caught.value)


def test_a_hook_that_raises_fails_its_plugin_and_rolls_back_its_registrations(plugin_dir, monkeypatch):
    plugin_dir(
        "dummy_raising",
        """
        from tokenloom.plugin_api import hookimpl

        @hookimpl
        def register_models(register):
            register("HalfDoneForCausalLM", "json:JSONDecoder")

        @hookimpl
        def register_tool_parsers(register):
            raise RuntimeError("boom")
    """,
    )
    plugin_dir.distribution("dummy-raising", "1.0", {"raising": "dummy_raising"})
    only_entry_points(monkeypatch, "raising")
    plugin_set = load_plugins()
    assert plugin_set.plugins == []
    [failure] = plugin_set.failures
    assert (
        failure.cause
        == f"register_tool_parsers raised RuntimeError: boom (at {plugin_dir.directory / 'dummy_raising.py'}:10)"
    )
    assert "HalfDoneForCausalLM" not in plugin_set.registry("model")


def test_a_misspelt_hook_fails_with_the_hook_it_meant(plugin_dir, monkeypatch):
    plugin_dir(
        "dummy_typo",
        """
        from tokenloom.plugin_api import hookimpl

        @hookimpl
        def register_tool_parser(register):
            register("never", "json:JSONDecoder")
    """,
    )
    plugin_dir.distribution("dummy-typo", "1.0", {"typo": "dummy_typo"})
    only_entry_points(monkeypatch, "typo")
    [failure] = load_plugins().failures
    assert "'register_tool_parser' is marked @hookimpl but is not a tokenloom hook" in failure.cause
    assert "did you mean 'register_tool_parsers'?" in failure.cause


def test_a_hook_with_the_wrong_argument_name_fails_its_plugin(plugin_dir, monkeypatch):
    plugin_dir(
        "dummy_badargs",
        """
        from tokenloom.plugin_api import hookimpl

        @hookimpl
        def register_models(add):
            add("X", "json:JSONDecoder")
    """,
    )
    plugin_dir.distribution("dummy-badargs", "1.0", {"badargs": "dummy_badargs"})
    only_entry_points(monkeypatch, "badargs")
    [failure] = load_plugins().failures
    assert failure.name == "badargs" and "add" in failure.cause


def test_plugin_module_option_loads_an_importable_module(plugin_dir):
    plugin_dir(
        "dummy_cli_module",
        """
        from tokenloom.plugin_api import hookimpl

        @hookimpl
        def register_load_formats(register):
            register("dummy_cli_format", "json:JSONDecoder")
    """,
    )
    plugin_set = load_plugins(modules=["dummy_cli_module"], entry_points=False)
    [info] = plugin_set.plugins
    assert (info.name, info.origin) == ("dummy_cli_module", "module dummy_cli_module")
    assert "dummy_cli_format" in plugin_set.registry("load_format")


def test_a_plugin_module_that_does_not_exist_is_fatal_naming_it(plugin_dir):
    # the operator named it: starting without it would be a surprise (issue 20)
    with pytest.raises(PluginError) as caught:
        load_plugins(modules=["no_such_plugin_module"], entry_points=False)
    assert (
        str(caught.value)
        == "--plugin no_such_plugin_module: ModuleNotFoundError: No module named 'no_such_plugin_module'"
    )


def test_a_plugin_module_that_fails_to_import_is_fatal_with_its_file_and_line(plugin_dir):
    path = plugin_dir(
        "dummy_bad_module",
        """
        from tokenloom.plugin_api import hookimpl
        import no_such_dependency_of_the_plugin
    """,
    )
    with pytest.raises(PluginError) as caught:
        load_plugins(modules=["dummy_bad_module"], entry_points=False)
    assert str(caught.value) == (
        "--plugin dummy_bad_module: ModuleNotFoundError: No module named "
        f"'no_such_dependency_of_the_plugin' (at {path}:3)"
    )


def test_plugin_module_already_loaded_by_its_entry_point_is_not_loaded_twice(plugin_dir, monkeypatch):
    plugin_dir("dummy_alpha", ALPHA)
    plugin_dir.distribution("dummy-alpha", "1.0", {"alpha": "dummy_alpha"})
    only_entry_points(monkeypatch, "alpha")
    plugin_set = load_plugins(modules=["dummy_alpha"])
    assert [info.name for info in plugin_set.plugins] == ["alpha"]
    assert plugin_set.failures == []


PARSER_FILE = """
    from tokenloom.plugin_api import ToolParser, hookimpl, register_tool_parser


    @register_tool_parser("decorated_parser")
    class DecoratedParser(ToolParser):
        pass


    class SubclassOfDecorated(DecoratedParser):
        # inherits the decorator's mark, but must not register "decorated_parser" again
        pass


    class HookedParser(ToolParser):
        pass


    @hookimpl
    def register_tool_parsers(register):
        register("hooked_parser", HookedParser)
"""


def test_tool_parser_plugin_file_registers_decorated_classes_and_hooks(plugin_dir, tmp_path):
    path = tmp_path / "my_parsers.py"
    path.write_text(textwrap.dedent(PARSER_FILE))
    plugin_set = load_plugins(files=[str(path)], entry_points=False)
    [info] = plugin_set.plugins
    assert (info.name, info.origin) == ("my_parsers.py", f"file {path}")
    assert sorted(info.registered["tool_parser"]) == ["decorated_parser", "hooked_parser"]
    registry = plugin_set.registry("tool_parser")
    assert registry.get("decorated_parser").__name__ == "DecoratedParser"
    assert registry.get("hooked_parser").__name__ == "HookedParser"
    # plain data for workers names the file, so a worker can import it without discovery
    assert registry.to_plain()["decorated_parser"]["target"] == f"{path.resolve()}:DecoratedParser"


def test_decorating_a_subclass_does_not_inherit_the_parent_names(plugin_dir, tmp_path):
    path = tmp_path / "two_parsers.py"
    path.write_text(
        textwrap.dedent("""
        from tokenloom.plugin_api import ToolParser, register_reasoning_parser, register_tool_parser

        @register_tool_parser("parent")
        class Parent(ToolParser):
            pass

        @register_tool_parser("child")
        class Child(Parent):
            pass

        @register_reasoning_parser("thinker")
        class Thinker:
            pass
    """)
    )
    plugin_set = load_plugins(files=[str(path)], entry_points=False)
    assert plugin_set.registry("tool_parser").get("child").__name__ == "Child"
    assert plugin_set.registry("tool_parser").get("parent").__name__ == "Parent"
    assert plugin_set.registry("reasoning_parser").get("thinker").__name__ == "Thinker"


def test_an_error_inside_a_tool_parser_plugin_file_names_the_file(plugin_dir, tmp_path):
    path = tmp_path / "broken_parser.py"
    path.write_text("import json\nraise ValueError('bad parser table')\n")
    with pytest.raises(PluginError) as caught:
        load_plugins(files=[str(path)], entry_points=False)
    assert str(path) in str(caught.value) and "ValueError: bad parser table" in str(caught.value)

    path = tmp_path / "syntax_error_parser.py"
    path.write_text("def broken(:\n")
    with pytest.raises(PluginError, match="syntax_error_parser.py: SyntaxError"):
        load_plugins(files=[str(path)], entry_points=False)

    with pytest.raises(PluginError, match="no such plugin file"):
        load_plugins(files=[str(tmp_path / "missing_parser.py")], entry_points=False)


def test_a_failing_hook_inside_a_tool_parser_plugin_file_names_the_file(plugin_dir, tmp_path):
    path = tmp_path / "duplicate_parsers.py"
    path.write_text(
        textwrap.dedent("""
        from tokenloom.plugin_api import register_tool_parser

        @register_tool_parser("twice")
        class One:
            pass

        @register_tool_parser("twice")
        class Two:
            pass
    """)
    )
    with pytest.raises(PluginError) as caught:
        load_plugins(files=[str(path)], entry_points=False)
    assert str(path) in str(caught.value) and "'twice' is registered twice" in str(caught.value)


def test_load_plugins_is_idempotent_and_takes_any_iterable(plugin_dir):
    plugin_dir(
        "dummy_idempotent",
        """
        from tokenloom.plugin_api import hookimpl

        CALLS = []

        @hookimpl
        def register_executors(register):
            CALLS.append(1)
            register("dummy_executor", "json:JSONDecoder")
    """,
    )
    first = load_plugins(modules=["dummy_idempotent"], entry_points=False)
    second = load_plugins(modules=(name for name in ["dummy_idempotent"]), entry_points=False)
    assert second is first
    assert sys.modules["dummy_idempotent"].CALLS == [1]  # hooks ran once
    assert [info.name for info in first.plugins] == ["dummy_idempotent"]


def test_importing_a_plugin_module_registers_nothing_until_load_plugins(plugin_dir):
    plugin_dir(
        "dummy_quiet",
        """
        from tokenloom.plugin_api import hookimpl

        @hookimpl
        def register_models(register):
            register("QuietForCausalLM", "json:JSONDecoder")
    """,
    )
    import dummy_quiet  # noqa: F401  (the import alone must do nothing)

    assert "QuietForCausalLM" not in load_plugins(entry_points=False).registry("model")
    assert "QuietForCausalLM" in load_plugins(modules=["dummy_quiet"], entry_points=False).registry("model")


# -- each hook is called and fills its own registry ------------------------------------------


EVERY_HOOK_MODULE = """
    from tokenloom.plugin_api import hookimpl
    from tokenloom.plugins.manager import PLUGIN_KINDS


    def add_routes(app, engine_client):
        app.routes_added.append("/dummy")


    @hookimpl
    def register_structured_output_backends(register):
        register("dummy_backend", "json:JSONDecoder")


    @hookimpl
    def register_api_routes(register):
        register("dummy_routes", add_routes)


    @hookimpl
    def register_reasoning_parsers(register):
        register("dummy_reasoning", "json:JSONDecoder")


    @hookimpl
    def register_tool_parsers(register):
        register("dummy_tools", "json:JSONDecoder")
"""


@pytest.fixture
def every_hook_plugin(plugin_dir):
    plugin_dir("dummy_every_hook", EVERY_HOOK_MODULE)
    return load_plugins(modules=["dummy_every_hook"], entry_points=False)


@pytest.mark.hook("register_structured_output_backends")
def test_register_structured_output_backends_fills_the_backend_registry(every_hook_plugin):
    registry = every_hook_plugin.registry("structured_output_backend")
    assert registry.names() == ["dummy_backend"] and registry.flag == "--guided-decoding-backend"
    assert registry.get("dummy_backend") is json.JSONDecoder


@pytest.mark.hook("register_api_routes")
def test_register_api_routes_targets_are_called_with_the_app(every_hook_plugin):
    class FakeApp:
        routes_added: list[str] = []

    add_routes = every_hook_plugin.registry("api_route").get("dummy_routes")
    app = FakeApp()
    add_routes(app, engine_client=None)
    assert app.routes_added == ["/dummy"]


@pytest.mark.hook("register_reasoning_parsers")
def test_register_reasoning_parsers_fills_the_reasoning_registry(every_hook_plugin):
    registry = every_hook_plugin.registry("reasoning_parser")
    assert registry.names() == ["dummy_reasoning"] and registry.flag == "--reasoning-parser"
    assert every_hook_plugin.plugins[0].registered["reasoning_parser"] == ["dummy_reasoning"]


@pytest.mark.hook("register_tool_parsers")
def test_register_tool_parsers_fills_the_tool_parser_registry(every_hook_plugin):
    registry = every_hook_plugin.registry("tool_parser")
    assert registry.names() == ["dummy_tools"] and registry.flag == "--tool-call-parser"


# -- the built-ins, registered through the real entry points in pyproject.toml ----------------


@pytest.fixture(scope="module")
def builtin_plugins():
    saved_cache, saved_env = manager._cache, manager.os.environ.pop(ENABLED_PLUGINS_ENV, None)
    manager._cache = {}
    try:
        yield load_plugins()
    finally:
        manager._cache = saved_cache
        if saved_env is not None:
            manager.os.environ[ENABLED_PLUGINS_ENV] = saved_env


def registered_by(plugin_set, entry_point: str, kind: str) -> list[str]:
    """What the built-in ``entry_point`` registered of ``kind``; fails with the cause if it did not load."""
    failure = next((failure for failure in plugin_set.failures if failure.name == entry_point), None)
    assert failure is None, f"built-in plugin {entry_point} failed to load: {failure.cause}"
    info = next((info for info in plugin_set.plugins if info.name == entry_point), None)
    assert info is not None, f"no entry point {entry_point!r}: reinstall tokenloom (pip install -e .)"
    assert info.origin.startswith("tokenloom "), info.origin
    return info.registered.get(kind, [])


@pytest.mark.hook("register_platforms")
def test_builtin_cpu_platform_is_registered(builtin_plugins):
    from tokenloom.plugin_api import Platform

    assert registered_by(builtin_plugins, "builtin_platforms", "platform") == ["cpu", "cuda"]
    platform_class = builtin_plugins.registry("platform").get("cpu")
    assert issubclass(platform_class, Platform) and platform_class.is_available()


@pytest.mark.hook("register_executors")
def test_builtin_executors_are_registered(builtin_plugins):
    from tokenloom.plugin_api import Executor

    assert registered_by(builtin_plugins, "builtin_executors", "executor") == ["uni", "mp", "ray"]
    for name in ("uni", "mp", "ray"):  # ray's module imports without Ray: Ray is imported on use
        assert issubclass(builtin_plugins.registry("executor").get(name), Executor)


@pytest.mark.hook("register_models")
def test_builtin_models_are_registered_by_architecture(builtin_plugins):
    import torch

    from tokenloom.builtin_plugins.models import MODELS

    assert registered_by(builtin_plugins, "builtin_models", "model") == list(MODELS)
    for architecture in MODELS:
        assert issubclass(builtin_plugins.registry("model").get(architecture), torch.nn.Module)


@pytest.mark.hook("register_load_formats")
def test_builtin_load_formats_are_registered(builtin_plugins):
    from tokenloom.plugin_api import LoadFormat

    names = ["safetensors", "pt", "gguf", "dummy"]  # --load-format auto asks them in this order
    assert registered_by(builtin_plugins, "builtin_load_formats", "load_format") == names
    for name in names:
        assert issubclass(builtin_plugins.registry("load_format").get(name), LoadFormat)


@pytest.mark.hook("register_quantization_methods")
def test_builtin_quantization_plugins_are_registered(builtin_plugins):
    from tokenloom.plugin_api import QuantizationConfig

    names = ["gguf", "compressed-tensors", "gptq", "awq"]  # the names checkpoints state (quant_method, a GGUF file)
    assert registered_by(builtin_plugins, "builtin_quantization", "quantization") == names
    for name in names:
        assert issubclass(builtin_plugins.registry("quantization").get(name), QuantizationConfig)


@pytest.mark.hook("register_model_sources")
def test_builtin_model_sources_are_registered(builtin_plugins):
    from tokenloom.plugin_api import ModelSource

    names = registered_by(builtin_plugins, "builtin_model_sources", "model_source")
    assert names == ["local", "huggingface", "pip_packages"]  # the order a tag is offered to them
    for name in names:
        assert issubclass(builtin_plugins.registry("model_source").get(name), ModelSource)


def test_every_builtin_kind_is_one_package_entry_point(builtin_plugins):
    """One registration convention: each built-in plugin is a package of builtin_plugins whose
    __init__ holds its hooks, registered as a third party's package is."""
    builtin = [info for info in builtin_plugins.plugins if info.origin.startswith("tokenloom ")]
    assert builtin and all(info.name.startswith("builtin_") for info in builtin), [i.name for i in builtin]
    from importlib_metadata import entry_points

    for entry_point in entry_points(group="tokenloom.plugins"):
        if entry_point.name.startswith("builtin_"):
            assert entry_point.value.count(".") == 2, entry_point  # tokenloom.builtin_plugins.<package>


def test_builtins_register_before_third_party_plugins(builtin_plugins):
    origins = [info.origin.split()[0] for info in builtin_plugins.plugins]
    first_third_party = next((i for i, origin in enumerate(origins) if origin != "tokenloom"), len(origins))
    assert all(origin != "tokenloom" for origin in origins[first_third_party:])
