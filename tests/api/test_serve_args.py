"""``tokenloom serve``'s arguments: every vLLM serve flag of the seed documents is known and
handled by its status, the flags land on their fields, --config precedence, and the plugin
names the flags choose are checked against the registries."""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import pytest

from tokenloom.api import flags
from tokenloom.api.flags import CPU_NOOP, FLAG_BY_NAME, FLAGS, IMPLEMENTED, NOOP, UNIMPLEMENTED
from tokenloom.api.serve_args import DEFAULT_MODEL, ServeArgs, check_plugin_choices, parse_serve_args
from tokenloom.api.server_config import ServerConfig
from tokenloom.core.config import EngineArgs, SpeculativeConfig
from tokenloom.errors import ConfigError, NotImplementedFlagError, PluginError, UnknownNameError
from tokenloom.plugins import manager

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
# vLLM's reference documents sit next to the checkout, in ../shared/seeds (not in the repository)
SEEDS = Path(os.environ.get("TOKENLOOM_SEEDS_DIR", REPO_ROOT.parent / "shared" / "seeds"))

SEED_FLAGS = (HERE / "vllm_seed_flags.txt").read_text().split()

# What the seed documents contain that is not a `serve` flag, and why.
SEED_EXCLUSIONS = {
    # `vllm bench latency` options (004): they belong to a later `tokenloom bench`
    "--batch-size",
    "--disable-detokenize",
    "--input-len",
    "--n",
    "--num-iters",
    "--num-iters-warmup",
    "--output-json",
    "--output-len",
    "--profile",
    "--use-beam-search",
    "--help",
    "-h",
    # vLLM's placeholder in its explanation of JSON flags
    "--json-arg",
    "--json-arg.key1",
    "--json-arg.key2.key3",
    "--json-arg.key4",
    "-json-arg",
    "-json-arg.key1",
    # typos and words run together in the rendered pages (001, 002, 003)
    "--enforce.-eager",
    "--ignore.-patterns",
    "--max-num.-partial-prefills",
    "--collects-detailed-traces",
    "--models",
    "--chat-templateoptional",
    "--enable-auto-tool-choicemandatory",
    "-tokenizer-pool-size0",
    # -O with its value attached (-O3, -O.level=3): tested below
    "-O3",
    "-O.level",
}


def extract_seed_flags(text: str) -> set[str]:
    short_aliases = {alias for flag in FLAGS for alias in flag.aliases}
    found = set()
    for token in re.findall(r"(?<![\w.\-/])(--?[A-Za-z][\w.\-]*)", text):
        if token.endswith("-"):
            continue  # a flag hyphenated across a line break
        token = token.rstrip(".")
        if token in SEED_EXCLUSIONS:
            continue
        if not token.startswith("--") and token not in short_aliases:
            token = "-" + token  # 002 renders --flag as -flag
        found.add(token)
    return found


def parse(*argv, **environ) -> ServeArgs:
    return parse_serve_args(list(argv), environ)


# -- the catalogue covers vLLM ----------------------------------------------------------------------


@pytest.mark.skipif(
    not SEEDS.is_dir(),
    reason=f"vLLM's seed documents are not at {SEEDS} (../shared/seeds next to the checkout; set TOKENLOOM_SEEDS_DIR to point elsewhere)",
)
def test_the_recorded_seed_flags_are_every_flag_in_the_seed_documents():
    text = "".join(path.read_text(encoding="utf-8") for path in sorted(SEEDS.glob("0*.txt")))
    assert extract_seed_flags(text) == set(SEED_FLAGS)


def test_every_seed_flag_is_in_the_catalogue():
    assert len(SEED_FLAGS) > 250
    missing = [name for name in SEED_FLAGS if name not in FLAG_BY_NAME]
    assert not missing, f"vLLM flags tokenloom does not know: {missing}"


def test_catalogue_is_consistent():
    flags.check_catalogue()  # implemented flags land on fields that exist
    options = [option for flag in FLAGS for option in flag.option_strings]
    assert len(options) == len(set(options)), "an option string belongs to two flags"
    assert len({flag.key for flag in FLAGS}) == len(FLAGS)
    for flag in FLAGS:
        assert flags.help_text(flag), f"{flag.name} has no help text"
        if flag.status in (CPU_NOOP, NOOP):
            assert flag.note, f"{flag.name} must say why it is ignored"
    for name in ("-tp", "-pp", "-q", "-O", "--no-enable-prefix-caching", "--no-trust-remote-code"):
        assert name in FLAG_BY_NAME


def sample_value(flag: flags.Flag) -> list[str]:
    """Tokens that give ``flag`` a value different from its default."""
    if flag.kind == "bool":
        return [flag.name]
    if flag.choices:
        return [flag.name, next(str(choice) for choice in flag.choices if choice != flags.default_value(flag))]
    value = {"int": "7", "float": "0.25", "size": "1k", "json": '{"a": 1}', "level_or_json": "3"}.get(flag.kind, "x")
    return [flag.name, value]


SAMPLES = {
    "--structured-outputs-config": ["--structured-outputs-config", '{"backend": "outlines"}'],
    "--enable-auto-tool-choice": ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
    "--enable-reasoning": ["--enable-reasoning", "--reasoning-parser", "qwen3"],
    "--gpu-memory-utilization": ["--gpu-memory-utilization", "0.5"],
    "--block-size": ["--block-size", "32"],
    "--generation-config": ["--generation-config", "vllm"],
    "--override-generation-config": ["--override-generation-config", '{"temperature": 0.5}'],
    "--attention-backend": ["--attention-backend", "torch"],
    "--config": None,  # a file: tested on its own
    # replicas on other nodes need Ray
    "--data-parallel-size-local": ["--data-parallel-size-local", "1", "-dp", "2", "--data-parallel-backend", "ray"],
    # draft-model settings: refused for ngram, tested on their own
    "--speculative-model-quantization": None,
    "--speculative-max-model-len": None,
    # speculative decoding needs a method and a number of tokens
    "--speculative-config": ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
    "--kv-events-config": ["--kv-events-config", '{"enable_kv_cache_events": true}'],
    # multi-node data parallelism: a node's share of a group
    "--headless": ["--headless", "-dp", "2", "-dpl", "1", "-dpr", "1", "-dpa", "head"],
    "--data-parallel-start-rank": ["--data-parallel-start-rank", "1", "-dp", "2", "-dpl", "1", "-dpa", "head"],
    "--data-parallel-rank": ["--data-parallel-rank", "1", "-dp", "2"],
    "--data-parallel-hybrid-lb": ["--data-parallel-hybrid-lb", "-dp", "2", "-dpl", "1", "-dpr", "1"],
    # one engine's workers across nodes: an equal share each, node 1 headless
    "--nnodes": ["--nnodes", "2", "-tp", "2"],
    "--node-rank": ["--node-rank", "1", "--nnodes", "2", "-tp", "2", "--headless"],
    "--collect-detailed-traces": ["--collect-detailed-traces", "all", "--otlp-traces-endpoint", "http://c:4317"],
    "--kv-transfer-config": ["--kv-transfer-config", '{"kv_connector": "SharedStorageConnector"}'],
    "--speculative-model": ["--speculative-model", "[ngram]", "--num-speculative-tokens", "2"],
    "--num-speculative-tokens": ["--num-speculative-tokens", "2", "--speculative-model", "[ngram]"],
    **{
        name: [name, value, "--speculative-model", "[ngram]", "--num-speculative-tokens", "2"]
        for name, value in (
            ("--speculative-draft-tensor-parallel-size", "1"),
            ("--speculative-disable-by-batch-size", "4"),
            ("--ngram-prompt-lookup-max", "4"),
            ("--ngram-prompt-lookup-min", "2"),
            ("--spec-decoding-acceptance-method", "rejection_sampler"),
        )
    },
    "--disable-logprobs-during-spec-decoding": [
        "--disable-logprobs-during-spec-decoding",
        "--speculative-model",
        "[ngram]",
        "--num-speculative-tokens",
        "2",
    ],
}


@pytest.mark.parametrize(
    "flag", [flag for flag in FLAGS if SAMPLES.get(flag.name, ()) is not None], ids=lambda flag: flag.name
)
def test_every_flag_is_handled_by_its_status(flag):
    argv = SAMPLES.get(flag.name) or sample_value(flag)
    if flag.status == UNIMPLEMENTED:
        with pytest.raises(NotImplementedFlagError) as caught:
            parse(*argv)
        assert str(caught.value).startswith(f"tokenloom does not implement {flag.name} yet")
        return
    serve_args = parse(*argv)
    if flag.status in (CPU_NOOP, NOOP):
        assert any(warning.startswith(flag.name) for warning in serve_args.warnings)
        without_flag = parse(*argv[1 if flag.kind == "bool" else 2 :])  # the flag itself changes nothing
        assert (serve_args.engine_kwargs, serve_args.server) == (without_flag.engine_kwargs, without_flag.server)
    else:
        assert flag.status == IMPLEMENTED
        assert serve_args.engine_kwargs != {"model": DEFAULT_MODEL} or serve_args.server != ServerConfig()


# -- parsing ------------------------------------------------------------------------------------------------


def test_defaults_serve_smollm2():
    serve_args = parse()
    assert serve_args.engine_kwargs == {"model": "smollm2"}
    assert isinstance(serve_args.engine_args, EngineArgs) and serve_args.engine_args.model == "smollm2"
    assert serve_args.server == ServerConfig() and serve_args.warnings == []


def test_engine_and_server_flags_land_on_their_fields():
    serve_args = parse(
        "qwen",
        "--max-model-len",
        "4096",
        "-tp",
        "1",
        "--pipeline-parallel-size",
        "1",
        "--kv-cache-dtype",
        "auto",
        "--served-model-name",
        "a",
        "b",
        "--port",
        "9001",
        "--host",
        "0.0.0.0",
        "--uvicorn-log-level",
        "debug",
        "--max-num-seqs",
        "8",
        "--hf-overrides",
        '{"rope_theta": 1000}',
        "--tool-call-parser",
        "hermes",
        "--enable-auto-tool-choice",
        "--chat-template",
        "t.jinja",
        "--reasoning-parser",
        "qwen3",
    )
    assert serve_args.engine_kwargs == {
        "model": "qwen",
        "max_model_len": 4096,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "cache_dtype": "auto",
        "served_model_name": ["a", "b"],
        "max_num_seqs": 8,
        "hf_overrides": {"rope_theta": 1000},
        "reasoning_parser": "qwen3",
    }
    server = serve_args.server
    assert (server.port, server.host, server.uvicorn_log_level) == (9001, "0.0.0.0", "debug")
    assert (server.tool_call_parser, server.enable_auto_tool_choice, server.chat_template) == (
        "hermes",
        True,
        "t.jinja",
    )
    config = serve_args.engine_args.create_engine_config()
    assert config.model.max_model_len == 4096 and config.structured_output.reasoning_parser == "qwen3"


def test_boolean_flags_take_no_forms_and_explicit_values():
    kwargs = parse(
        "--no-enable-prefix-caching",
        "--disable-sliding-window",
        "--enable-chunked-prefill",
        "false",
        "--skip-tokenizer-init=true",
        "--guided-decoding-disable-fallback",
        "True",
    ).engine_kwargs
    assert kwargs["enable_prefix_caching"] is False and kwargs["disable_sliding_window"] is True
    assert kwargs["enable_chunked_prefill"] is False and kwargs["skip_tokenizer_init"] is True
    assert kwargs["guided_decoding_disable_fallback"] is True
    assert parse("--disable-sliding-window", "smollm2").engine_kwargs["model"] == "smollm2"  # never eats the model
    with pytest.raises(ConfigError, match="expected true or false"):
        parse("--disable-sliding-window=maybe")


def test_human_readable_sizes_and_underscored_flag_names():
    kwargs = parse(
        "--max-model-len", "2K", "--max_num_batched_tokens=1.5k", "--kv-cache-memory-bytes", "1G"
    ).engine_kwargs
    assert kwargs == {
        "model": DEFAULT_MODEL,
        "max_model_len": 2048,
        "max_num_batched_tokens": 1500,
        "kv_cache_memory_bytes": 1024**3,
    }
    with pytest.raises(ConfigError, match="'2.5' is not a whole number|not an integer"):
        parse("--max-model-len", "2.5")


def test_json_flags_take_vllm_dotted_form_and_merge():
    kwargs = parse(
        "--hf-overrides",
        '{"a": {"b": 1}}',
        "--hf-overrides.a.c",
        "x",
        "--hf-overrides.rope_theta=5e5",
        "--rope-scaling.items+",
        "p",
        "--rope-scaling.items+=q,r",
    ).engine_kwargs
    assert kwargs["hf_overrides"] == {"a": {"b": 1, "c": "x"}, "rope_theta": 500000.0}
    assert kwargs["rope_scaling"] == {"items": ["p", "q", "r"]}
    with pytest.raises(ConfigError, match="expected a JSON object"):
        parse("--rope-scaling", "[1, 2]")


def test_old_and_new_names_of_the_same_setting():
    assert parse("--guided-decoding-backend", "xgrammar").engine_kwargs["guided_decoding_backend"] == "xgrammar"
    kwargs = parse(
        "--structured-outputs-config", '{"backend": "outlines", "disable_any_whitespace": true}'
    ).engine_kwargs
    assert kwargs["guided_decoding_backend"] == "outlines" and kwargs["guided_decoding_disable_any_whitespace"] is True
    assert (
        parse("--structured-outputs-config.backend", "xgrammar").engine_kwargs["guided_decoding_backend"] == "xgrammar"
    )
    with pytest.raises(ConfigError, match="set guided_decoding_backend to different values"):
        parse("--guided-decoding-backend", "xgrammar", "--structured-outputs-config.backend", "outlines")
    with pytest.raises(ConfigError, match="unknown key 'colour'"):
        parse("--structured-outputs-config", '{"colour": "red"}')
    assert parse("--pooler-config", '{"pooling_type": "MEAN"}').engine_kwargs["override_pooler_config"] == {
        "pooling_type": "MEAN"
    }
    serve_args = parse("--worker-use-ray")
    assert serve_args.engine_kwargs["distributed_executor_backend"] == "ray"
    assert "use --distributed-executor-backend ray" in serve_args.warnings[0]


def test_enable_reasoning_is_accepted_with_a_reasoning_parser_only():
    serve_args = parse("--enable-reasoning", "--reasoning-parser", "deepseek_r1")
    assert serve_args.engine_kwargs["reasoning_parser"] == "deepseek_r1"
    assert serve_args.warnings[0].startswith("--enable-reasoning has no effect")
    with pytest.raises(ConfigError, match="--enable-reasoning needs --reasoning-parser"):
        parse("--enable-reasoning")


def test_unimplemented_flags_are_refused_by_name_unless_given_their_default():
    with pytest.raises(NotImplementedFlagError, match=r"^tokenloom does not implement --additional-config yet"):
        parse("--additional-config", '{"key": "x"}')
    with pytest.raises(NotImplementedFlagError, match=r"only its default, --num-scheduler-steps 1, is accepted"):
        parse("--num-scheduler-steps", "8")
    with pytest.raises(NotImplementedFlagError, match="HF_TOKEN"):
        parse("--hf-token")
    # the value that changes nothing passes silently: configs copied from vLLM keep working
    assert parse("--num-scheduler-steps", "1", "--no-enable-lora", "--preemption-mode", "recompute").warnings == []


def test_cpu_noop_flags_are_accepted_with_one_warning_each():
    serve_args = parse("--swap-space", "8", "--cuda-graph-sizes", "1", "2", "4", "-O3", "--disable-custom-all-reduce")
    assert serve_args.engine_kwargs == {"model": DEFAULT_MODEL}
    assert [warning.split()[0] for warning in serve_args.warnings] == [
        "--swap-space",
        "--cuda-graph-sizes",
        "--compilation-config",
        "--disable-custom-all-reduce",
    ]
    assert all("no meaning on the CPU" in warning for warning in serve_args.warnings)
    assert parse("-O", '{"level": 3}').warnings and parse("-O.level=3").warnings


def test_unknown_flags_get_the_closest_match():
    with pytest.raises(ConfigError, match=r"unrecognized argument: --max-model-lenght; did you mean --max-model-len\?"):
        parse("--max-model-lenght", "10")
    with pytest.raises(ConfigError, match="unrecognized argument: --frobnicate"):
        parse("--frobnicate")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dtype", "int3"], "invalid choice: 'int3'"),
        (["--block-size", "24"], "--block-size: must be a positive power of two"),
        (["--port", "70000"], "--port: must be in 0..65535"),
        (["--max-num-seqs", "many"], "argument --max-num-seqs: invalid int value"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
        (["a", "b"], "unexpected arguments: b"),
        (["a", "--model", "b"], "the model is given twice"),
    ],
)
def test_bad_values_are_config_errors(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(*argv)


def test_model_positional_or_flag():
    assert parse("--model", "qwen").engine_kwargs["model"] == "qwen"
    assert parse("qwen", "--model", "qwen").engine_kwargs["model"] == "qwen"
    assert parse("--port", "8001", "gemma3-270m").engine_kwargs["model"] == "gemma3-270m"


def test_api_key_from_the_environment_when_the_flag_is_absent():
    assert parse(TOKENLOOM_API_KEY="secret").server.api_key == ["secret"]
    assert parse("--api-key", "flag-key", TOKENLOOM_API_KEY="secret").server.api_key == ["flag-key"]
    assert parse("--api-key", "a", "--api-key", "b").server.api_key == ["a", "b"]
    assert parse().server.api_key is None


def test_plugin_flags_are_collected_for_load_plugins():
    server = parse(
        "--plugin",
        "pkg_a",
        "--plugin",
        "pkg_b",
        "--tool-parser-plugin",
        "p.py",
        "--middleware",
        "m:one",
        "--allowed-origins",
        '["http://a", "http://b"]',
    ).server
    assert server.plugins == ["pkg_a", "pkg_b"] and server.tool_parser_plugin == ["p.py"]
    assert server.middleware == ["m:one"] and server.allowed_origins == ["http://a", "http://b"]


# -- --config FILE.yaml ------------------------------------------------------------------------------------


def write_config(tmp_path, text: str) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_config_file_precedence_command_line_over_file_over_defaults(tmp_path):
    path = write_config(
        tmp_path,
        """
        model: qwen
        max_model_len: 2048
        max-num-seqs: 16
        port: 9000
        enable-prefix-caching: false
        served-model-name: [alpha, beta]
        middleware: ["m:one", "m:two"]
        hf-overrides: {rope_theta: 10000}
    """,
    )
    serve_args = parse("--config", path, "--max-model-len", "4096", "--port", "9100")
    assert serve_args.engine_kwargs == {
        "model": "qwen",
        "max_model_len": 4096,
        "max_num_seqs": 16,
        "enable_prefix_caching": False,
        "served_model_name": ["alpha", "beta"],
        "hf_overrides": {"rope_theta": 10000},
    }
    assert serve_args.server.port == 9100 and serve_args.server.middleware == ["m:one", "m:two"]
    assert serve_args.server.host == ServerConfig().host  # neither: the default
    assert parse("smollm2", "--config", path).engine_kwargs["model"] == "smollm2"


def test_config_file_values_go_through_the_same_checks(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'max_model_lenght'; did you mean 'max-model-len'\?"):
        parse("--config", write_config(tmp_path, "max_model_lenght: 5\n"))
    with pytest.raises(ConfigError, match="invalid int value"):
        parse("--config", write_config(tmp_path, "max-num-seqs: lots\n"))
    with pytest.raises(NotImplementedFlagError, match="does not implement --enable-lora-bias"):
        parse("--config", write_config(tmp_path, "enable-lora-bias: true\n"))
    with pytest.raises(ConfigError, match="expected a mapping"):
        parse("--config", write_config(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="No such file"):
        parse("--config", str(tmp_path / "missing.yaml"))
    assert "--swap-space" in parse("--config", write_config(tmp_path, "swap_space: 8\n")).warnings[0]


# -- plugin names chosen by flags ---------------------------------------------------------------------------


@pytest.fixture
def hermes_only_plugins(monkeypatch):
    """``manager.load_plugins`` answering with one registered tool parser, ``hermes``."""
    from tokenloom.plugins.manager import PluginSet, new_registries

    registries = new_registries()
    registries["tool_parser"].register("hermes", "json:JSONDecoder", plugin_name="builtins")
    plugin_set = PluginSet(registries, [], [])
    monkeypatch.setattr(manager, "load_plugins", lambda *args, **kwargs: plugin_set)
    return plugin_set


def test_check_plugin_choices_skips_auto_and_reads_backend_options(hermes_only_plugins):
    serve_args = parse("--guided-decoding-backend", "auto", "--load-format", "auto", "--device", "auto")
    serve_args.plugins = manager.load_plugins()
    check_plugin_choices(serve_args)  # nothing to look up
    serve_args = parse("--guided-decoding-backend", "xgrammar:disable-any-whitespace")
    serve_args.plugins = manager.load_plugins()
    with pytest.raises(UnknownNameError, match="unknown structured_output_backend 'xgrammar'"):
        check_plugin_choices(serve_args)


def test_check_plugin_choices_imports_the_chosen_targets_naming_plugin_and_name(hermes_only_plugins):
    hermes_only_plugins.registry("tool_parser").register("typo", "json:JSONDecodr", plugin_name="my_plugin")
    serve_args = parse("--tool-call-parser", "typo")
    serve_args.plugins = manager.load_plugins()
    with pytest.raises(PluginError) as caught:
        check_plugin_choices(serve_args)
    assert str(caught.value) == (
        "tool_parser 'typo' (registered by plugin 'my_plugin'): plugin target "
        "'json:JSONDecodr': module 'json' has no attribute 'JSONDecodr'"
    )
    serve_args = parse("--tool-call-parser", "hermes")  # a parser left unchosen is not imported
    serve_args.plugins = manager.load_plugins()
    check_plugin_choices(serve_args)


def test_check_plugin_choices_imports_every_api_route_and_middleware(hermes_only_plugins):
    hermes_only_plugins.registry("api_route").register("routes", "no_such_module_xyz:add", plugin_name="web")
    serve_args = parse()
    serve_args.plugins = manager.load_plugins()
    with pytest.raises(
        PluginError,
        match=r"^api_route 'routes' \(registered by plugin 'web'\): cannot import "
        r"plugin target 'no_such_module_xyz:add': ModuleNotFoundError",
    ):
        check_plugin_choices(serve_args)
    hermes_only_plugins.registry("api_route").register("routes", "json:dumps", plugin_name="web", override=True)
    serve_args = parse("--middleware", "json:no_such_middleware")
    serve_args.plugins = manager.load_plugins()
    with pytest.raises(ConfigError, match="--middleware 'json:no_such_middleware'"):
        check_plugin_choices(serve_args)


def test_lora_flags_reach_the_engine_and_server():
    serve_args = parse(
        "--enable-lora",
        "--max-loras",
        "4",
        "--max-lora-rank",
        "32",
        "--max-cpu-loras",
        "8",
        "--lora-dtype",
        "bfloat16",
        "--lora-modules",
        "a=/adapters/a",
        '{"name": "b", "path": "org/b", "base_model_name": "smollm2"}',
        "--fully-sharded-loras",
    )
    assert {key: serve_args.engine_kwargs[key] for key in ("enable_lora", "max_loras", "max_lora_rank")} == {
        "enable_lora": True,
        "max_loras": 4,
        "max_lora_rank": 32,
    }
    assert serve_args.engine_kwargs["max_cpu_loras"] == 8 and serve_args.engine_kwargs["lora_dtype"] == "bfloat16"
    assert serve_args.server.lora_modules == [
        "a=/adapters/a",
        '{"name": "b", "path": "org/b", "base_model_name": "smollm2"}',
    ]
    assert len(serve_args.warnings) == 1 and "--fully-sharded-loras" in serve_args.warnings[0]
    with pytest.raises(NotImplementedFlagError, match="--lora-extra-vocab-size"):
        parse("--lora-extra-vocab-size", "512")


# -- speculative decoding: --speculative-config and the older flags ---------------------------


def test_speculative_config_json_becomes_the_engine_config():
    serve_args = parse(
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "disable_by_batch_size": 8}',
    )
    speculative = serve_args.engine_args.create_engine_config().speculative
    assert speculative is not None
    assert (speculative.method, speculative.num_speculative_tokens) == ("ngram", 4)
    # one bound given: the other equals it, as vLLM does
    assert (speculative.prompt_lookup_min, speculative.prompt_lookup_max) == (3, 3)
    assert speculative.disable_by_batch_size == 8


def test_adaptive_draft_length_keys_reach_the_engine_config():
    default = parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}')
    speculative = default.engine_args.create_engine_config().speculative
    assert (speculative.adaptive_num_speculative_tokens, speculative.verify_row_cost) == (True, None)
    serve_args = parse(
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 4, "adaptive_num_speculative_tokens": false, '
        '"verify_row_cost": 0.25}',
    )
    speculative = serve_args.engine_args.create_engine_config().speculative
    assert (speculative.adaptive_num_speculative_tokens, speculative.verify_row_cost) == (False, 0.25)


def test_older_speculative_flags_map_onto_the_config():
    serve_args = parse(
        "--speculative-model",
        "[ngram]",
        "--num-speculative-tokens",
        "5",
        "--ngram-prompt-lookup-min",
        "2",
        "--ngram-prompt-lookup-max",
        "4",
        "--speculative-disable-by-batch-size",
        "3",
    )
    assert serve_args.engine_kwargs["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": 5,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
        "disable_by_batch_size": 3,
    }
    speculative = serve_args.engine_args.create_engine_config().speculative
    assert (speculative.prompt_lookup_min, speculative.prompt_lookup_max) == (2, 4)


def test_speculative_flags_merge_with_the_json_and_conflicts_are_refused():
    serve_args = parse("--speculative-config", '{"method": "ngram"}', "--num-speculative-tokens", "2")
    assert serve_args.engine_kwargs["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="set the speculative num_speculative_tokens to different values"):
        parse(
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--num-speculative-tokens", "2"
        )


@pytest.mark.parametrize(
    "options, message",
    [
        ('{"method": "ngram"}', '"num_speculative_tokens" is required'),
        ('{"num_speculative_tokens": 3}', 'give "method"'),
        ('{"method": "ngram", "num_speculative_tokens": 0}', r"num_speculative_tokens must be an integer in \[1, 64\]"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
            r"prompt_lookup_min \(4\) must not exceed prompt_lookup_max \(2\)",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}', "unknown key 'lookahead'"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "quantization": "gguf"}',
            "quantization describes a draft model",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "max_model_len": 512}',
            "max_model_len describes a draft model",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "acceptance_method": "typical_acceptance_sampler"}',
            "acceptance_method 'typical_acceptance_sampler' is not implemented",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "adaptive_num_speculative_tokens": "no"}',
            "adaptive_num_speculative_tokens must be true or false, got 'no'",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "verify_row_cost": -0.1}',
            r"verify_row_cost must be a number in \[0, 10\]",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "verify_row_cost": "low"}',
            "verify_row_cost must be a number",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "adaptive_draft": true}', "unknown key 'adaptive_draft'"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "disable_logprobs": "yes"}', "disable_logprobs must be"),
    ],
)
def test_bad_speculative_configs_say_what_to_change(options, message):
    with pytest.raises(ConfigError, match=message):
        parse("--speculative-config", options)


def test_disable_logprobs_changes_nothing_and_true_says_so():
    """tokenloom returns the logprobs asked for while speculating: ``false`` is what it does, and
    ``true`` (skip them) is accepted with a warning that it has no effect, as the old flag is."""
    plain = parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}')
    for value in ("true", "false"):
        given = parse(
            "--speculative-config", f'{{"method": "ngram", "num_speculative_tokens": 2, "disable_logprobs": {value}}}'
        )
        built = SpeculativeConfig.from_dict(given.engine_args.speculative_config)
        assert built == SpeculativeConfig.from_dict(plain.engine_args.speculative_config)
        assert given.warnings == (
            [
                "--speculative-config: disable_logprobs has no effect in tokenloom (the logprobs a request asks "
                "for are always returned while speculating, computed by the target model); ignored"
            ]
            if value == "true"
            else []
        )
    flag = parse(
        "--disable-logprobs-during-spec-decoding", "--speculative-model", "[ngram]", "--num-speculative-tokens", "2"
    )
    assert any(warning.startswith("--disable-logprobs-during-spec-decoding has no effect") for warning in flag.warnings)


@pytest.mark.parametrize(
    "speculation",
    [
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
        ["--speculative-model", "smollm2", "--num-speculative-tokens", "3"],
    ],
)
def test_speculation_under_pipeline_parallelism_is_refused_naming_both_flags(speculation):
    """Refused while the config is built, before a worker starts, whichever flags ask for it."""
    with pytest.raises(ConfigError) as refused:
        parse(*speculation, "--pipeline-parallel-size", "2")
    message = str(refused.value)
    assert "--speculative-config" in message and "--pipeline-parallel-size 2" in message
    assert refused.value.param == "speculative-config"
    parse(*speculation, "--pipeline-parallel-size", "1")  # one stage: accepted


@pytest.mark.parametrize(
    "flag, value, key",
    [
        ("--speculative-model-quantization", "gguf", "quantization"),
        ("--speculative-max-model-len", "512", "max_model_len"),
    ],
)
def test_speculative_draft_model_flags_are_refused_for_ngram(flag, value, key):
    """n-gram lookup runs no draft model: its settings would be read by nothing, so they are refused."""
    with pytest.raises(ConfigError, match=f"{key} describes a draft model"):
        parse("--speculative-model", "[ngram]", "--num-speculative-tokens", "2", flag, value)


def test_older_draft_model_flags_map_onto_the_config():
    serve_args = parse(
        "--speculative-model",
        "smollm2",
        "--num-speculative-tokens",
        "3",
        "--speculative-model-quantization",
        "gguf",
        "--speculative-max-model-len",
        "512",
    )
    assert serve_args.engine_kwargs["speculative_config"] == {
        "model": "smollm2",
        "num_speculative_tokens": 3,
        "quantization": "gguf",
        "max_model_len": 512,
    }
    speculative = serve_args.engine_args.create_engine_config().speculative
    # a draft model and no method: vLLM's draft_model
    assert (speculative.method, speculative.model, speculative.quantization, speculative.max_model_len) == (
        "draft_model",
        "smollm2",
        "gguf",
        512,
    )


@pytest.mark.parametrize(
    "options, message",
    [
        ('{"method": "draft_model", "num_speculative_tokens": 3}', 'method "draft_model" needs "model"'),
        ('{"method": "draft_model", "model": 3, "num_speculative_tokens": 3}', '"model" must be a model name or path'),
        (
            '{"method": "draft_model", "model": "smollm2", "num_speculative_tokens": 3, "prompt_lookup_max": 2}',
            "prompt_lookup_max configures n-gram lookup",
        ),
    ],
)
def test_bad_draft_model_configs_say_what_to_change(options, message):
    with pytest.raises(ConfigError, match=message):
        parse("--speculative-config", options)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "nats"}'],
            r"--kv-events-config: publisher 'nats' is not implemented; use one of null, zmq",
        ),
        (["--kv-events-config", '{"buffer_step": 5}'], r"--kv-events-config: unknown key 'buffer_step'"),
        (["--kv-events-config", '{"hwm": 0}'], r"--kv-events-config: hwm must be a whole number of at least 1"),
    ],
)
def test_bad_kv_events_configs_say_what_to_change(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv)


def test_kv_events_config_takes_vllms_keys_and_defaults():
    """vLLM's form, JSON or dotted keys; the publisher defaults to zmq once events are enabled."""
    from tokenloom.core.config import KVEventsConfig

    given = parse("--kv-events-config", '{"enable_kv_cache_events": true, "topic": "kv", "buffer_steps": 8}')
    dotted = parse(
        "--kv-events-config.enable_kv_cache_events", "true", "--kv-events-config.topic", "kv",
        "--kv-events-config.buffer_steps", "8",
    )  # fmt: skip
    for serve_args in (given, dotted):
        config = serve_args.engine_args.create_engine_config().kv_events
        assert config == KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", topic="kv", buffer_steps=8)
        assert config.publishes and config.endpoint == "tcp://*:5557" and config.hwm == 100_000
    assert not parse().engine_args.create_engine_config().kv_events.publishes


def test_missing_pyzmq_is_a_start_up_error_naming_the_extra(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "zmq" else real_find_spec(name, *a)
    )
    with pytest.raises(ConfigError, match=r"pip install 'tokenloom\[kv-events\]'"):
        parse("--kv-events-config", '{"enable_kv_cache_events": true}').engine_args.create_engine_config()
