"""The ``tokenloom`` command: subcommands, exit codes and messages, the hand-over from ``serve``
to the server, `tokenloom plugins` / `version`, and that --help and version import nothing
heavy. (Serve's flags: test_serve_args.py; its help: test_serve_help.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import types
from importlib.machinery import ModuleSpec

import pytest

from tokenloom.api.cli import main
from tokenloom.plugins import manager

# -- main: exit codes and messages --------------------------------------------------------------------------


def test_unimplemented_flag_exits_2_naming_it(capsys):
    assert main(["serve", "--additional-config", "{}"]) == 2
    assert "tokenloom does not implement --additional-config yet" in capsys.readouterr().err


def test_unknown_flag_exits_2_with_a_suggestion(capsys):
    assert main(["serve", "--tensor-paralel-size", "2"]) == 2
    assert "did you mean --tensor-parallel-size?" in capsys.readouterr().err


def test_unknown_command_suggests_one(capsys):
    assert main(["serv"]) == 2
    assert "did you mean 'serve'?" in capsys.readouterr().err


def test_version(capsys):
    from tokenloom import __version__

    assert main(["version"]) == 0 and capsys.readouterr().out == f"tokenloom {__version__}\n"
    assert main(["--version"]) == 0


@pytest.fixture
def fake_server(monkeypatch):
    """A stand-in tokenloom.api.server and plugin set: what serve hands over, and with what."""
    from tokenloom.plugins.manager import PluginSet, new_registries

    calls: dict = {}
    module = types.ModuleType("tokenloom.api.server")
    module.__spec__ = ModuleSpec("tokenloom.api.server", None)

    def run_server(serve_args):
        calls["serve_args"] = serve_args
        return 0

    module.run_server = run_server
    monkeypatch.setitem(sys.modules, "tokenloom.api.server", module)
    registries = new_registries()
    registries["tool_parser"].register("hermes", "json:JSONDecoder", plugin_name="builtins")
    plugin_set = PluginSet(registries, [], [])

    def fake_load_plugins(modules=(), files=(), strict=False, **_):
        calls["load_plugins"] = (list(modules), list(files))
        calls["strict"] = strict
        return plugin_set

    calls["real_load_plugins"] = manager.load_plugins
    monkeypatch.setattr(manager, "load_plugins", fake_load_plugins)
    return calls


def test_serve_loads_the_named_plugins_and_hands_over_serve_args(fake_server):
    assert (
        main(
            [
                "serve",
                "qwen",
                "--plugin",
                "my_pkg",
                "--tool-parser-plugin",
                "p.py",
                "--tool-call-parser",
                "hermes",
                "--port",
                "8123",
            ]
        )
        == 0
    )
    assert fake_server["load_plugins"] == (["my_pkg"], ["p.py"])
    serve_args = fake_server["serve_args"]
    assert serve_args.engine_kwargs["model"] == "qwen" and serve_args.server.port == 8123
    assert serve_args.plugins.registry("tool_parser").names() == ["hermes"]


def test_serve_passes_strict_plugins_on(fake_server):
    assert main(["serve", "--strict-plugins"]) == 0 and fake_server["strict"] is True
    assert main(["serve"]) == 0 and fake_server["strict"] is False


def test_serve_refuses_to_start_when_a_named_plugin_module_fails(fake_server, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(manager, "load_plugins", fake_server["real_load_plugins"])
    monkeypatch.setattr(manager, "_cache", {})
    monkeypatch.setenv(manager.ENABLED_PLUGINS_ENV, "builtin_executors")
    (tmp_path / "half_written_plugin.py").write_text("import json\nfrom tokenloom.plugin_api import hookimpl, nope\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["serve", "--plugin", "half_written_plugin"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "tokenloom serve: error: --plugin half_written_plugin: ImportError: "
        "cannot import name 'nope' from 'tokenloom.plugin_api'"
    )
    assert err.endswith(f"(at {tmp_path / 'half_written_plugin.py'}:2)\n")
    assert "serve_args" not in fake_server  # the server never started


def test_serve_rejects_a_parser_no_plugin_registered(fake_server, capsys):
    assert main(["serve", "--tool-call-parser", "hermez"]) == 2
    err = capsys.readouterr().err
    assert "unknown tool_parser 'hermez' (for --tool-call-parser)" in err and "did you mean 'hermes'?" in err
    assert "serve_args" not in fake_server


def test_top_level_help_lists_the_subcommands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("serve", "plugins", "version"):
        assert re.search(rf"^  {name}\b", out, re.MULTILINE)


HEAVY_MODULES = (
    "torch",
    "transformers",
    "numpy",
    "fastapi",
    "pydantic",
    "uvicorn",
    "yaml",
    "safetensors",
    "gguf",
    "tokenloom.builtin_plugins",
    "tokenloom.plugins.manager",
)


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["serve", "--help=ModelConfig"], ["version"]])
def test_help_and_version_import_nothing_heavy(argv):
    """What keeps them answering at once (under 1 s: timed by benchmarks/cli_startup.py, not
    here, where a loaded machine stretches any time several-fold)."""
    probe = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from tokenloom.api.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            code = main({argv!r})
        heavy = sorted(name for name in sys.modules if name.startswith({HEAVY_MODULES!r}))
        print(json.dumps({{"code": code, "heavy": heavy}}))
    """)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    report = json.loads(result.stdout)
    assert report["code"] == 0 and report["heavy"] == []


# -- tokenloom plugins ------------------------------------------------------------------------------------------


def test_plugins_lists_a_file_plugin_as_json_and_text(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(manager, "_cache", {})
    monkeypatch.setenv(manager.ENABLED_PLUGINS_ENV, "builtin_executors,not_installed")
    plugin_file = tmp_path / "shout_parser.py"
    plugin_file.write_text(
        textwrap.dedent("""
        from tokenloom.plugin_api import ToolParser, register_tool_parser

        @register_tool_parser("shout")
        class ShoutParser(ToolParser):
            pass
    """)
    )
    assert main(["plugins", "--json", "--tool-parser-plugin", str(plugin_file)]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert {
        "name": "shout_parser.py",
        "origin": f"file {plugin_file}",
        "registered": {"tool_parser": ["shout"]},
    } in listing["plugins"]
    assert {
        "name": "builtin_executors",
        "origin": "tokenloom 0.1.0",
        "registered": {"executor": ["uni", "mp", "ray"]},
    } in listing["plugins"]
    assert [failure["name"] for failure in listing["failures"]] == ["not_installed"]

    assert main(["plugins", "--tool-parser-plugin", str(plugin_file)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 plugins loaded, 1 failed")
    assert f"shout_parser.py  (file {plugin_file})\n  tool_parser: shout" in out
    assert "failed:\n  not_installed  (TOKENLOOM_PLUGINS): TOKENLOOM_PLUGINS names 'not_installed'" in out


def test_plugins_reports_a_broken_plugin_file_with_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(manager.ENABLED_PLUGINS_ENV, "builtin_executors")
    plugin_file = tmp_path / "broken.py"
    plugin_file.write_text("raise RuntimeError('no')\n")
    assert main(["plugins", "--tool-parser-plugin", str(plugin_file)]) == 2
    assert f"{plugin_file}: RuntimeError: no" in capsys.readouterr().err


def test_plugins_command_imports_no_heavy_module():
    """Registrations are lazy strings: listing plugins must not import torch. An entry-point
    module that imports torch at its top fails this test; keep its @hookimpl functions in a
    module without heavy imports."""
    env = {key: value for key, value in os.environ.items() if key != manager.ENABLED_PLUGINS_ENV}
    probe = (
        "import contextlib, io, sys\nfrom tokenloom.api.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n    main(['plugins'])\n"
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    if result.stdout.split()[-1] == "False":
        return
    import importlib_metadata

    offenders = []
    for entry_point in importlib_metadata.entry_points(group=manager.ENTRY_POINT_GROUP):
        probe = f"import importlib, sys\nimportlib.import_module({entry_point.value!r})\nprint('torch' in sys.modules)"
        check = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
        if check.returncode == 0 and check.stdout.split()[-1] == "True":
            offenders.append(f"{entry_point.name} ({entry_point.value})")
    pytest.fail(f"`tokenloom plugins` imports torch; entry-point modules that import it: {offenders}")


def test_plugins_check_imports_every_target_and_names_the_broken_ones(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(manager, "_cache", {})
    monkeypatch.setenv(manager.ENABLED_PLUGINS_ENV, "builtin_executors")
    plugin_file = tmp_path / "typo_targets.py"
    plugin_file.write_text(
        textwrap.dedent("""
        from tokenloom.plugin_api import hookimpl

        @hookimpl
        def register_tool_parsers(register):
            register("fine", "json:JSONDecoder")
            register("typo", "json:JSONDecodr")
    """)
    )
    assert main(["plugins", "--check", "--tool-parser-plugin", str(plugin_file)]) == 1
    out = capsys.readouterr().out
    # the three executors, 'fine' and not 'typo'
    assert "check: 4 of 5 registered targets import" in out
    assert (
        "  tool_parser 'typo': tool_parser 'typo' (registered by plugin 'typo_targets.py'): plugin target "
        "'json:JSONDecodr': module 'json' has no attribute 'JSONDecodr'"
    ) in out

    assert main(["plugins", "--check", "--json", "--tool-parser-plugin", str(plugin_file)]) == 1
    assert [item["name"] for item in json.loads(capsys.readouterr().out)["unresolved"]] == ["typo"]
    assert main(["plugins", "--tool-parser-plugin", str(plugin_file)]) == 0  # listing alone imports nothing


def test_the_real_command_refuses_a_broken_named_plugin_and_with_strict_a_broken_installed_one(tmp_path):
    """As an operator meets it: `tokenloom serve` in a subprocess exits 2 before loading a model."""
    (tmp_path / "dummy_broken_ep.py").write_text("import json\njson.loads('{')\n")
    info = tmp_path / "dummy_broken_ep-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dummy-broken-ep\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[tokenloom.plugins]\nbroken_ep = dummy_broken_ep\n")
    env = {key: value for key, value in os.environ.items() if key != manager.ENABLED_PLUGINS_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))

    def serve(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "tokenloom", "serve", *argv], capture_output=True, text=True, env=env, timeout=120
        )

    result = serve("--plugin", "no_such_plugin_module")
    assert result.returncode == 2, result.stderr
    assert (
        "tokenloom serve: error: --plugin no_such_plugin_module: ModuleNotFoundError: "
        "No module named 'no_such_plugin_module'"
    ) in result.stderr
    result = serve("--strict-plugins")
    assert result.returncode == 2, result.stderr
    assert "--strict-plugins: plugin 'broken_ep' (dummy-broken-ep 0.1) failed to load: JSONDecodeError" in result.stderr
    assert f"(at {tmp_path / 'dummy_broken_ep.py'}:2, raised in " in result.stderr


def test_a_model_that_does_not_load_is_one_line_naming_it_and_the_traceback_is_for_debug(tmp_path):
    """`tokenloom serve ./nope` and a corrupt GGUF, as an operator meets them: exit 1, the
    error is one line naming the file (no traceback), and TOKENLOOM_LOGGING_LEVEL=DEBUG shows it."""
    corrupt = tmp_path / "model.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(20))

    def serve(model: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "tokenloom", "serve", model, "--port", "1"],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            timeout=180,
            cwd=tmp_path,
        )

    for model, named in (("./nope", f"{tmp_path / 'nope'} does not exist"), (str(corrupt), str(corrupt))):
        result = serve(model)
        assert result.returncode == 1, result.stderr
        errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and errors[0] == result.stderr.splitlines()[-1], result.stderr
        assert errors[0].startswith("tokenloom serve: error: ") and named in errors[0], result.stderr
        assert errors[0].endswith("(the traceback: TOKENLOOM_LOGGING_LEVEL=DEBUG)")
        assert "Traceback" not in result.stderr
    debug = serve("./nope", TOKENLOOM_LOGGING_LEVEL="DEBUG")
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.splitlines()[-1].startswith("tokenloom serve: error: ")


def test_a_typo_in_a_model_plugins_target_is_one_line_naming_the_plugin(tmp_path, tiny_llama_dir):
    """Issue 40: model targets reach the engine as plain data; a typo in one is one line naming
    the plugin that registered it (exit 2, no traceback), not ``'<resolved in main process>'``."""
    plugin = tmp_path / "typo_model.py"
    plugin.write_text(
        textwrap.dedent("""
        from tokenloom.plugin_api import hookimpl

        @hookimpl
        def register_models(register):
            register("LlamaForCausalLM", "my_models.llama:MyLlamForCausalLM", override=True)
    """)
    )
    result = subprocess.run(
        [sys.executable, "-m", "tokenloom", "serve", str(tiny_llama_dir), "--tool-parser-plugin", str(plugin)]
        + ["--port", "1"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == (
        "tokenloom serve: error: model 'LlamaForCausalLM' (registered by plugin 'typo_model.py'): cannot import "
        "plugin target 'my_models.llama:MyLlamForCausalLM': ModuleNotFoundError: No module named 'my_models'"
    ), result.stderr
    assert "Traceback" not in result.stderr


def test_plugins_says_why_a_plugin_registered_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(manager, "_cache", {})
    monkeypatch.setenv(manager.ENABLED_PLUGINS_ENV, "builtin_executors")
    idle_hooks = tmp_path / "idle_hooks.py"
    idle_hooks.write_text(
        textwrap.dedent("""
        from tokenloom.plugin_api import hookimpl

        @hookimpl
        def register_tool_parsers(register):
            pass  # registers only when some condition holds
    """)
    )
    no_hooks = tmp_path / "no_hooks.py"
    no_hooks.write_text("class Parser:\n    pass\n")
    assert main(["plugins", "--tool-parser-plugin", str(idle_hooks), "--tool-parser-plugin", str(no_hooks)]) == 0
    out = capsys.readouterr().out
    assert (
        f"idle_hooks.py  (file {idle_hooks})\n  (registered nothing: its hooks (register_tool_parsers) ran and called "
        "register for nothing)"
    ) in out
    assert (
        f"no_hooks.py  (file {no_hooks})\n  (registered nothing: it implements no hook (functions marked @hookimpl) "
        'and marks no class (@register_tool_parser("name")))'
    ) in out
