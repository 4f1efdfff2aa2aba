"""``tokenloom models``: every registered architecture with its runner, the load formats that
read it (GGUF under llama.cpp's names) and its plugin, a plugin's own included; no torch
imported; and docs/models.md is exactly its ``--markdown`` output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tokenloom.api.cli import main
from tokenloom.plugins import manager

REPO = Path(__file__).resolve().parents[2]


def run_models_command(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    probe = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from tokenloom.api.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["models", *{list(args)!r}])
        print(json.dumps({{"code": code, "out": out.getvalue(), "torch": "torch" in sys.modules}}))
    """)
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)


def built_in_only_env() -> dict[str, str]:
    """The environment with only tokenloom's own entry-point plugins enabled."""
    from importlib.metadata import entry_points

    built_ins = [
        point.name for point in entry_points(group=manager.ENTRY_POINT_GROUP) if point.name.startswith("builtin_")
    ]
    return {**os.environ, manager.ENABLED_PLUGINS_ENV: ",".join(built_ins)}


def test_the_listing_reads_the_registries_without_importing_torch():
    result = run_models_command("--json", env=built_in_only_env())
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["code"] == 0 and report["torch"] is False
    rows = {row["architecture"]: row for row in json.loads(report["out"])["architectures"]}
    assert rows["LlamaForCausalLM"] == {
        "architecture": "LlamaForCausalLM",
        "runner": "generate",
        "load_formats": {"safetensors": None, "pt": None, "gguf": ["llama"], "dummy": None},
        "plugin": "builtin_models",
        "origin": rows["LlamaForCausalLM"]["origin"],
    }
    assert rows["LlamaForCausalLM"]["origin"].startswith("tokenloom ")
    assert rows["BertModel"]["runner"] == "pooling" and "gguf" not in rows["BertModel"]["load_formats"]
    assert rows["Gemma3ForCausalLM"]["load_formats"]["gguf"] == ["gemma3"]
    # MistralForCausalLM files in GGUF say "llama": they load as Llama
    assert "gguf" not in rows["MistralForCausalLM"]["load_formats"]


def test_docs_models_md_is_the_generated_listing():
    result = run_models_command("--markdown", env=built_in_only_env())
    assert result.returncode == 0, result.stderr
    generated = json.loads(result.stdout)["out"]
    committed = (REPO / "docs" / "models.md").read_text(encoding="utf-8")
    assert committed == generated, "docs/models.md is stale: run `tokenloom models --markdown > docs/models.md`"


def test_a_plugin_s_architecture_and_load_format_are_listed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(manager, "_cache", {})
    monkeypatch.setenv(manager.ENABLED_PLUGINS_ENV, "builtin_load_formats,builtin_models")
    (tmp_path / "tiny_models_plugin.py").write_text(
        textwrap.dedent("""
        from tokenloom.plugin_api import LoadFormat, hookimpl

        class TinyFormat(LoadFormat):
            architecture_names = {"tiny-v1": "TinyForCausalLM", "tiny-v2": "TinyForCausalLM"}

        @hookimpl
        def register_models(register):
            register("TinyForCausalLM", "tiny_models_plugin_model:TinyForCausalLM")
            register("TinyEncoder", "tiny_models_plugin_model:TinyEncoder", runner="pooling")

        @hookimpl
        def register_load_formats(register):
            register("tiny", TinyFormat)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["models", "--json", "--plugin", "tiny_models_plugin"]) == 0
    rows = {row["architecture"]: row for row in json.loads(capsys.readouterr().out)["architectures"]}
    assert rows["TinyForCausalLM"] == {
        "architecture": "TinyForCausalLM",
        "runner": "generate",
        "load_formats": {"safetensors": None, "pt": None, "dummy": None, "tiny": ["tiny-v1", "tiny-v2"]},
        "plugin": "tiny_models_plugin",
        "origin": "module tiny_models_plugin",
    }
    assert rows["TinyEncoder"]["runner"] == "pooling" and "tiny" not in rows["TinyEncoder"]["load_formats"]
    assert "tiny" not in rows["LlamaForCausalLM"]["load_formats"]

    assert main(["models", "--plugin", "tiny_models_plugin"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{len(rows)} architectures tokenloom serves natively\n")
    line = next(line for line in out.splitlines() if line.startswith("TinyForCausalLM "))
    assert line.split() == [
        "TinyForCausalLM",
        "generate",
        "safetensors,",
        "pt,",
        "dummy,",
        "tiny",
        "(tiny-v1,",
        "tiny-v2)",
        "tiny_models_plugin",
    ]
