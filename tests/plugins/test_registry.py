"""Registries: registration, duplicates and overrides, unknown names, lazy targets, and the
plain-data form worker processes receive."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from tokenloom.errors import ConfigError, PluginError, UnknownNameError
from tokenloom.plugins.manager import PLUGIN_KINDS, PluginSet, new_registries
from tokenloom.plugins.registry import Registry, closest_match, import_file, resolve_target


class FirstParser:
    pass


class SecondParser:
    pass


def test_register_and_get_returns_the_target():
    registry = Registry("tool_parser", "--tool-call-parser")
    registry.register("first", FirstParser, plugin_name="plugin_a")
    assert registry.get("first") is FirstParser
    assert registry.entry("first").plugin_name == "plugin_a"
    assert "first" in registry and len(registry) == 1


def test_duplicate_name_is_an_error_naming_both_plugins():
    registry = Registry("tool_parser")
    registry.register("hermes", FirstParser, plugin_name="plugin_a")
    with pytest.raises(PluginError) as caught:
        registry.register("hermes", SecondParser, plugin_name="plugin_b")
    assert "'plugin_a'" in str(caught.value) and "'plugin_b'" in str(caught.value)
    assert "override=True" in str(caught.value)
    assert registry.get("hermes") is FirstParser  # the first registration stands


def test_override_replaces_deliberately():
    registry = Registry("tool_parser")
    registry.register("hermes", FirstParser, plugin_name="plugin_a")
    registry.register("hermes", SecondParser, plugin_name="plugin_b", override=True)
    assert registry.get("hermes") is SecondParser
    assert registry.entry("hermes").plugin_name == "plugin_b"


def test_unknown_name_lists_known_names_the_flag_and_the_closest_match():
    registry = Registry("tool_parser", "--tool-call-parser")
    for name in ("hermes", "mistral", "llama3_json"):
        registry.register(name, FirstParser, plugin_name="builtins")
    with pytest.raises(UnknownNameError) as caught:
        registry.get("hermse")
    message = str(caught.value)
    assert "unknown tool_parser 'hermse'" in message and "--tool-call-parser" in message
    assert "hermes, llama3_json, mistral" in message
    assert "did you mean 'hermes'?" in message
    assert caught.value.suggestion == "hermes"
    assert isinstance(caught.value, ConfigError)  # a start-up error: the CLI exits 2


def test_unknown_name_in_an_empty_registry_says_none_are_registered():
    with pytest.raises(UnknownNameError, match="registered: none"):
        Registry("reasoning_parser").get("deepseek_r1")


def test_closest_match_falls_back_to_a_case_insensitive_match():
    assert closest_match("LLAMAFORCAUSALLM", ["LlamaForCausalLM", "Qwen2ForCausalLM"]) == "LlamaForCausalLM"
    assert closest_match("zzz", ["hermes"]) is None


@pytest.mark.parametrize("name", ["", None, 3])
def test_invalid_names_are_rejected(name):
    with pytest.raises(PluginError, match="invalid name"):
        Registry("model").register(name, FirstParser, plugin_name="p")


def test_a_target_that_is_neither_callable_nor_a_string_is_rejected():
    with pytest.raises(PluginError, match="expected a class, a callable or a 'module:attr' string"):
        Registry("model").register("x", 42, plugin_name="p")


def test_string_targets_are_imported_on_first_use_only(tmp_path, monkeypatch):
    (tmp_path / "lazy_target_module.py").write_text("class Target:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy_target_module", raising=False)
    registry = Registry("model")
    registry.register("Target", "lazy_target_module:Target", plugin_name="p")
    assert "lazy_target_module" not in sys.modules
    target = registry.get("Target")
    assert target.__name__ == "Target" and "lazy_target_module" in sys.modules
    assert registry.get("Target") is target


def test_resolve_target_errors_say_what_is_wrong():
    with pytest.raises(PluginError, match="not of the form 'module:attr'"):
        resolve_target("json.JSONDecoder")
    with pytest.raises(PluginError, match="cannot import plugin target 'no_such_module_xyz:Thing'"):
        resolve_target("no_such_module_xyz:Thing")
    with pytest.raises(PluginError, match="has no attribute 'Nope'"):
        resolve_target("json:Nope")
    with pytest.raises(PluginError, match="defined inside a function"):
        resolve_target("tests.plugins.test_registry:make.<locals>.Local")
    assert resolve_target("json:JSONDecoder.decode") is json.JSONDecoder.decode


def test_import_file_imports_once_per_path_and_names_missing_files(tmp_path):
    path = tmp_path / "once.py"
    path.write_text("COUNT = []\nCOUNT.append(1)\n")
    assert import_file(str(path)) is import_file(str(path))
    assert import_file(str(path)).COUNT == [1]
    with pytest.raises(FileNotFoundError, match="no such plugin file"):
        import_file(str(tmp_path / "missing.py"))


def test_plain_round_trip_keeps_names_order_and_targets(tmp_path):
    plugin_file = tmp_path / "file_plugin.py"
    plugin_file.write_text("class FromFile:\n    pass\n")
    from_file = import_file(str(plugin_file)).FromFile

    registry = Registry("tool_parser", "--tool-call-parser")
    registry.register("zeta", "json:JSONDecoder", plugin_name="a")
    registry.register("alpha", FirstParser, plugin_name="b")
    registry.register("file", from_file, plugin_name="c")
    plain = registry.to_plain()
    assert {name: entry["target"] for name, entry in plain.items()} == {
        "zeta": "json:JSONDecoder",
        "alpha": f"{__name__}:FirstParser",
        "file": f"{plugin_file.resolve()}:FromFile",
    }
    json.dumps(plain)  # plain data: what crosses to worker processes

    rebuilt = Registry.from_plain("tool_parser", plain)
    assert rebuilt.names() == ["zeta", "alpha", "file"]  # `auto` choices depend on the order
    assert rebuilt.get("zeta") is json.JSONDecoder
    assert rebuilt.get("alpha") is FirstParser
    assert rebuilt.get("file") is from_file
    assert [entry.plugin_name for entry in rebuilt.entries()] == ["a", "b", "c"]  # named in their errors


def test_a_bad_target_resolved_from_plain_data_names_the_plugin_that_registered_it():
    registry = Registry("model", "--model")
    registry.register("TypoForCausalLM", "tokenloom.no_such_module:Model", plugin_name="acme-models", runner="generate")
    rebuilt = Registry.from_plain("model", json.loads(json.dumps(registry.to_plain())))
    assert rebuilt.entry("TypoForCausalLM").options == {"runner": "generate"}
    with pytest.raises(PluginError, match="registered by plugin 'acme-models'"):
        rebuilt.get("TypoForCausalLM")


def test_plugin_set_plain_round_trip_covers_every_kind_and_keeps_flags():
    registries = new_registries()
    registries["model"].register("LlamaForCausalLM", "json:JSONDecoder", plugin_name="p")
    registries["tool_parser"].register("first", FirstParser, plugin_name="p")
    tables = PluginSet(registries, [], []).to_plain()
    assert set(tables) == {kind.name for kind in PLUGIN_KINDS}
    rebuilt = PluginSet.from_plain(json.loads(json.dumps(tables)))
    assert rebuilt.registry("model").get("LlamaForCausalLM") is json.JSONDecoder
    assert rebuilt.registry("tool_parser").get("first") is FirstParser
    assert rebuilt.registry("tool_parser").flag == "--tool-call-parser"
    assert rebuilt.to_plain() == tables


def test_copy_is_independent_of_the_original():
    registry = Registry("model", "--model")
    registry.register("a", FirstParser, plugin_name="p")
    duplicate = registry.copy()
    duplicate.register("b", SecondParser, plugin_name="q")
    assert registry.names() == ["a"] and duplicate.names() == ["a", "b"]
    assert duplicate.flag == "--model"


def make():
    class Local:
        pass

    return Local


def test_a_local_class_is_refused_when_resolved_from_plain_data():
    registry = Registry("model")
    registry.register("Local", make(), plugin_name="p")
    plain = registry.to_plain()
    assert "<locals>" in plain["Local"]["target"]
    with pytest.raises(PluginError, match="define it at module level"):
        Registry.from_plain("model", plain).get("Local")


def test_file_targets_in_plain_data_resolve_without_rerunning_discovery(tmp_path):
    plugin_file = tmp_path / "standalone_parser.py"
    plugin_file.write_text(
        textwrap.dedent("""
        class StandaloneParser:
            pass
    """)
    )
    resolved = resolve_target(f"{plugin_file}:StandaloneParser")
    assert resolved.__name__ == "StandaloneParser"


def test_plugin_api_exports_every_lazy_name_and_resolves_it():
    from tokenloom import plugin_api

    assert set(plugin_api.__all__) == {
        "Register",
        "hookimpl",
        "register_reasoning_parser",
        "register_tool_parser",
        *plugin_api._LAZY,
    }
    for name in plugin_api._LAZY:
        assert getattr(plugin_api, name) is not None
