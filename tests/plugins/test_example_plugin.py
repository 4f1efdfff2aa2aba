"""The third-party example plugin (examples/tokenloom-example-plugin): its tool parser, model
source and model (ArceeForCausalLM, built from tokenloom.model_api alone) work, and once
pip-installed it is discovered through its real entry-point metadata and serves its model."""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tokenloom.errors import ModelLoadError

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "tokenloom-example-plugin"


@pytest.fixture(scope="module")
def example_modules():
    """The example package imported from its source directory (no installation)."""
    sys.path.insert(0, str(EXAMPLE_DIR))
    try:
        from tokenloom_example_plugin import call_tags, example_source

        yield call_tags, example_source
    finally:
        sys.path.remove(str(EXAMPLE_DIR))
        for name in [name for name in sys.modules if name.startswith("tokenloom_example_plugin")]:
            del sys.modules[name]


@pytest.fixture(scope="module")
def example_model_file():
    """The example's model file imported from its source directory (no installation)."""
    sys.path.insert(0, str(EXAMPLE_DIR))
    try:
        from tokenloom_example_plugin import modeling_arcee

        yield modeling_arcee
    finally:
        sys.path.remove(str(EXAMPLE_DIR))
        for name in [name for name in sys.modules if name.startswith("tokenloom_example_plugin")]:
            del sys.modules[name]


# -- the tool parser -----------------------------------------------------------------------------

OUTPUT = (
    'Let me check. <call>{"name": "get_weather", "arguments": {"city": "Paris"}}</call>'
    ' and <call>{"name": "get_time", "arguments": {}}</call> done <'
)


def calls_of(tool_calls):
    return [(call.name, json.loads(call.arguments)) for call in tool_calls]


def streamed(parser, pieces):
    """(content, [(name, arguments)], indices) from feeding ``pieces`` one by one."""
    content, calls, indices = [], [], []
    messages = [parser.extract_delta(piece, None) for piece in pieces] + [parser.finish(None)]
    for message in filter(None, messages):
        content.append(message.content or "")
        for delta in message.tool_calls:
            calls.append((delta.name, json.loads(delta.arguments)))
            indices.append(delta.index)
            assert delta.id.startswith("call_")
    return "".join(content), calls, indices


def test_extract_finds_calls_and_keeps_the_text_around_them(example_modules):
    call_tags, _ = example_modules
    result = call_tags.CallTagToolParser(None).extract(OUTPUT, None)
    assert result.tools_called
    assert calls_of(result.tool_calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert result.content == "Let me check.  and  done <"
    assert len({call.id for call in result.tool_calls}) == 2


@pytest.mark.parametrize(
    "text",
    [
        "<call>not json</call>",
        '<call>{"arguments": {}}</call>',  # no name
        '<call>{"name": "f", "arguments": [1]}</call>',  # arguments not an object
        '<call>{"name": "f"}',  # never closed
        "plain answer",
    ],
)
def test_malformed_or_absent_calls_stay_content(example_modules, text):
    call_tags, _ = example_modules
    result = call_tags.CallTagToolParser(None).extract(text, None)
    assert not result.tools_called and result.tool_calls == [] and result.content == text


def test_every_two_and_three_way_split_streams_the_same_result(example_modules):
    call_tags, _ = example_modules
    expected = call_tags.CallTagToolParser(None).extract(OUTPUT, None)
    cuts = range(1, len(OUTPUT))
    for cut_points in itertools.chain(
        itertools.combinations(cuts, 1), random.Random(0).sample(list(itertools.combinations(cuts, 2)), 400)
    ):
        bounds = (0, *cut_points, len(OUTPUT))
        pieces = [OUTPUT[start:end] for start, end in zip(bounds, bounds[1:])]
        content, calls, indices = streamed(call_tags.CallTagToolParser(None), pieces)
        assert content == expected.content, pieces
        assert calls == calls_of(expected.tool_calls), pieces
        assert indices == [0, 1]


@pytest.mark.parametrize("text", ["<call>not json</call> tail", 'x <call>{"name": "f"}', "a < b <ca", "<<call>"])
def test_streaming_matches_extract_on_odd_inputs_character_by_character(example_modules, text):
    call_tags, _ = example_modules
    expected = call_tags.CallTagToolParser(None).extract(text, None)
    content, calls, _ = streamed(call_tags.CallTagToolParser(None), list(text))
    assert content == (expected.content or "") and calls == calls_of(expected.tool_calls)


def test_streaming_holds_back_only_what_may_start_a_call(example_modules):
    call_tags, _ = example_modules
    parser = call_tags.CallTagToolParser(None)
    # text before a call is kept verbatim (as vLLM keeps it), so only "<ca" waits
    assert parser.extract_delta("Hello <ca", None).content == "Hello "
    assert parser.extract_delta("t", None).content == "<cat"  # not a tag after all
    assert parser.extract_delta('<call>{"name": "f"', None) is None  # inside a call: nothing yet
    message = parser.extract_delta("}</call>", None)
    assert message.content is None and message.tool_calls[0].name == "f"


# -- the model source ------------------------------------------------------------------------------


def test_model_source_resolves_directories_and_gguf_files_in_order(example_modules, tmp_path, monkeypatch):
    _, example_source = example_modules
    first, second = tmp_path / "first", tmp_path / "second"
    (first / "tiny").mkdir(parents=True)
    second.mkdir()
    (second / "tiny.gguf").write_bytes(b"GGUF")
    (second / "other.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("TOKENLOOM_EXAMPLE_MODELS", os.pathsep.join([str(first), str(second)]))
    source = example_source.ExampleModelSource()
    assert source.matches("example:tiny") and not source.matches("HuggingFaceTB/SmolLM2-135M")
    resolved = source.resolve("example:tiny")
    assert (resolved.path, resolved.name, resolved.source, resolved.load_format) == (
        str(first / "tiny"),
        "tiny",
        "example",
        None,
    )
    resolved = source.resolve("example:other")
    assert (resolved.path, resolved.load_format) == (str(second / "other.gguf"), "gguf")
    with pytest.raises(ModelLoadError, match="available: other, tiny"):
        source.resolve("example:missing")


def test_model_source_says_which_variable_to_set(example_modules, monkeypatch):
    _, example_source = example_modules
    monkeypatch.delenv("TOKENLOOM_EXAMPLE_MODELS", raising=False)
    with pytest.raises(ModelLoadError, match="set TOKENLOOM_EXAMPLE_MODELS"):
        example_source.ExampleModelSource().resolve("example:tiny")
    with pytest.raises(ModelLoadError, match="write example:NAME"):
        example_source.ExampleModelSource().resolve("example:")


# -- the model ---------------------------------------------------------------------------------------

ARCEE_PROMPTS = [[5, 17, 99, 3, 42, 7], [120, 4], [33, 61, 2, 90, 11, 150, 23, 8]]


def hf_arcee(seed: int = 0, **overrides):
    import torch
    from helpers.model_parity import randomize_parameters
    from transformers import ArceeConfig, ArceeForCausalLM

    tiny = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    return randomize_parameters(ArceeForCausalLM(ArceeConfig(**{**tiny, **overrides})).eval(), seed)


def test_the_model_file_imports_only_the_public_model_api():
    source = (EXAMPLE_DIR / "tokenloom_example_plugin" / "modeling_arcee.py").read_text(encoding="utf-8")
    imported = {
        line.split()[1] for line in source.splitlines() if line.startswith(("from tokenloom", "import tokenloom"))
    }
    assert imported == {"tokenloom.model_api"}


def test_plugins_md_shows_the_model_file_whole():
    source = (EXAMPLE_DIR / "tokenloom_example_plugin" / "modeling_arcee.py").read_text(encoding="utf-8")
    plugins_md = (EXAMPLE_DIR.parents[1] / "PLUGINS.md").read_text(encoding="utf-8")
    assert f"```python\n{source}```" in plugins_md, "copy modeling_arcee.py into PLUGINS.md's register_models example"


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}])
def test_the_example_model_matches_transformers(example_model_file, overrides):
    from helpers.model_parity import assert_matches_transformers, build_model

    hf_model = hf_arcee(seed=3, **overrides)
    model, loaded = build_model(example_model_file.ArceeForCausalLM, hf_model.config, hf_model.state_dict().items())
    assert {"model.layers.2.mlp.up_proj.weight", "model.layers.2.self_attn.qkv_proj.weight"} <= loaded
    assert_matches_transformers(model, hf_model, ARCEE_PROMPTS, num_new_tokens=6)


def test_the_example_model_refuses_a_gated_checkpoint_by_name(example_model_file):
    """A Llama checkpoint under Arcee's name: its gate_proj has no parameter here."""
    import torch
    from helpers.model_parity import build_model

    hf_model = hf_arcee()
    weights = [*hf_model.state_dict().items(), ("model.layers.0.mlp.gate_proj.weight", torch.ones(96, 64))]
    with pytest.raises(ModelLoadError, match=r"no parameter for: model\.layers\.0\.mlp\.gate_proj\.weight"):
        build_model(example_model_file.ArceeForCausalLM, hf_model.config, weights)


# -- the int8 weight-only quantization ----------------------------------------------------------


def test_int8_checkpoint_loads_through_the_quantization_plugin_alone(example_modules, tiny_llama_dir, tmp_path):
    """The checkpoint's extra tensors (weight_scale) reach the layers with no load-format plugin,
    the quantization is detected from config.json, and the output is transformers' on the same
    weights dequantized."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, LlamaForCausalLM

    from tokenloom import LLM, SamplingParams

    quantized_dir, reference_dir = tmp_path / "int8", tmp_path / "reference"
    shutil.copytree(tiny_llama_dir, quantized_dir)
    shutil.copytree(tiny_llama_dir, reference_dir)
    state = load_file(str(Path(tiny_llama_dir) / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in state.items():
        ignored = name.startswith("model.layers.1.mlp.down_proj.")  # stays dense, as the config says
        if name.startswith("model.layers.") and name.endswith("_proj.weight") and not ignored:
            scale = tensor.abs().amax(dim=1) / 127
            codes = torch.round(tensor / scale.unsqueeze(1)).to(torch.int8)
            quantized[name], quantized[name.replace(".weight", ".weight_scale")] = codes, scale
            dequantized[name] = codes.float() * scale.unsqueeze(1)
        else:
            quantized[name] = dequantized[name] = tensor
    save_file(quantized, str(quantized_dir / "model.safetensors"))
    save_file(dequantized, str(reference_dir / "model.safetensors"))
    config = json.loads((quantized_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "example-int8", "ignore": ["model.layers.1.mlp.down_proj"]}
    (quantized_dir / "config.json").write_text(json.dumps(config))

    llm = LLM(model=str(quantized_dir), plugins=["tokenloom_example_plugin"], dtype="float32", max_model_len=128)
    try:
        assert llm.engine.model_info.quantization == "example-int8"
        [output] = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
        layers = llm.engine.executor.worker.runner.model.model.layers
        assert layers[0].self_attn.qkv_proj.weight.dtype == torch.int8
        assert layers[1].mlp.down_proj.quant_method.name == "none"  # the ignore list
    finally:
        llm.engine.shutdown()
    tokenizer = AutoTokenizer.from_pretrained(reference_dir)
    model = LlamaForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
    assert list(output.outputs[0].token_ids) == expected


# -- installed with pip, discovered through its entry point ------------------------------------------


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory):
    """The example installed with pip into a fresh directory (offline, no dependencies)."""
    source = tmp_path_factory.mktemp("source") / "tokenloom-example-plugin"
    # a copy: pip builds in the source tree and would leave build/ and *.egg-info in examples/
    shutil.copytree(EXAMPLE_DIR, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return target


def run_tokenloom(args: list[str], pythonpath: Path | None, **env_updates) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "TOKENLOOM_PLUGINS"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    env.update(env_updates)
    script = Path(sys.executable).with_name("tokenloom")
    command = (
        [str(script)]
        if script.exists()
        else [sys.executable, "-c", "import sys; from tokenloom.api.cli import main; sys.exit(main())"]
    )
    return subprocess.run(command + args, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.hook("register_tool_parsers")
@pytest.mark.hook("register_model_sources")
@pytest.mark.hook("register_models")
def test_tokenloom_plugins_lists_the_installed_example(installed_example):
    assert list(installed_example.glob("tokenloom_example_plugin-0.1.0.dist-info/entry_points.txt"))
    result = run_tokenloom(["plugins", "--json"], installed_example)
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    [example] = [plugin for plugin in listing["plugins"] if plugin["name"] == "example"]
    assert example["origin"] == "tokenloom-example-plugin 0.1.0"
    assert example["registered"] == {
        "tool_parser": ["example_call_tags"],
        "model_source": ["example"],
        "model": ["ArceeForCausalLM"],
        "quantization": ["example-int8"],
    }
    # the text listing shows it too
    text = run_tokenloom(["plugins"], installed_example, TOKENLOOM_PLUGINS="example")
    assert "example  (tokenloom-example-plugin 0.1.0)" in text.stdout
    assert "tool_parser: example_call_tags" in text.stdout


def test_without_installation_there_is_no_example_plugin():
    result = run_tokenloom(["plugins", "--json"], None, TOKENLOOM_PLUGINS="example")
    listing = json.loads(result.stdout)
    assert listing["plugins"] == []
    assert listing["failures"][0]["name"] == "example"


def test_installed_example_resolves_lazily_and_works(installed_example, tmp_path):
    (tmp_path / "tiny").mkdir()
    check = textwrap.dedent("""
        import json, sys
        from tokenloom.plugins.manager import load_plugins

        plugin_set = load_plugins()
        lazy = "tokenloom_example_plugin.call_tags" not in sys.modules
        parser = plugin_set.registry("tool_parser").get("example_call_tags")(None)
        result = parser.extract('<call>{"name": "f", "arguments": {"x": 1}}</call>', None)
        source = plugin_set.registry("model_source").get("example")()
        print(json.dumps({"lazy": lazy, "calls": [[c.name, c.arguments] for c in result.tool_calls],
                          "path": source.resolve("example:tiny").path,
                          "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules)}))
    """)
    env = {key: value for key, value in os.environ.items()}
    env.update(PYTHONPATH=str(installed_example), TOKENLOOM_PLUGINS="example", TOKENLOOM_EXAMPLE_MODELS=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report == {"lazy": True, "calls": [["f", '{"x": 1}']], "path": str(tmp_path / "tiny"), "heavy": []}


def test_installed_example_model_is_listed_and_serves_transformers_greedy_tokens(installed_example, tmp_path):
    """The worked example of PLUGINS.md end to end: pip-installed, ``tokenloom models`` lists its
    architecture, and ``LLM(model=...)`` on an Arcee checkpoint finds the model through the entry
    point and generates transformers' greedy tokens."""
    from helpers.model_parity import assert_greedy_agrees, hf_greedy_top_k

    listing = run_tokenloom(["models", "--json"], installed_example)
    assert listing.returncode == 0, listing.stderr
    [row] = [row for row in json.loads(listing.stdout)["architectures"] if row["architecture"] == "ArceeForCausalLM"]
    assert (row["plugin"], row["origin"], row["runner"]) == ("example", "tokenloom-example-plugin 0.1.0", "generate")

    hf_model = hf_arcee(seed=5)
    hf_model.save_pretrained(tmp_path / "arcee")
    expected = [hf_greedy_top_k(hf_model, prompt, 8) for prompt in ARCEE_PROMPTS]
    assert all(len(set(tokens)) > 3 for tokens, _ in expected), "greedy decoding is degenerate"
    serve = textwrap.dedent(f"""
        import json
        from helpers.model_parity import served_greedy_top_k
        from tokenloom import LLM

        llm = LLM(model={str(tmp_path / "arcee")!r}, dtype="float32", max_model_len=64,
                  kv_cache_memory_bytes=2**20, skip_tokenizer_init=True)
        served = served_greedy_top_k(llm, {ARCEE_PROMPTS!r}, 8)
        print(json.dumps([[tokens, [sorted(step) for step in top]] for tokens, top in served]))
    """)
    tests_dir = Path(__file__).resolve().parents[1]
    env = {key: value for key, value in os.environ.items() if key != "TOKENLOOM_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(installed_example), str(tests_dir), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", serve], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    served = [(tokens, [set(step) for step in top]) for tokens, top in json.loads(result.stdout.splitlines()[-1])]
    assert_greedy_agrees(served, expected)
