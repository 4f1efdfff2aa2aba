"""The catalogue of ``tokenloom serve`` flags, by vLLM's names, as data.

Each :class:`Flag` names its vLLM group, where its value goes (an :class:`EngineArgs`
field or a :class:`ServerConfig` field), its type, and a status: ``implemented``,
``cpu_noop`` (accepted, warned: it means nothing on the CPU), ``noop`` (accepted, warned:
vLLM itself ignores it, or it concerns something tokenloom never does) or
``unimplemented`` (rejected by name, unless given the value that changes nothing).
Implemented flags take their help text and default from the config dataclasses' attribute
docstrings. Importing this module is cheap: no torch, no plugins.

Long on purpose: most of it is the catalogue itself, one entry per vLLM ``serve`` flag, as
data; the parsing helpers are a small part.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from tokenloom.errors import ConfigError

IMPLEMENTED = "implemented"
CPU_NOOP = "cpu_noop"
NOOP = "noop"
UNIMPLEMENTED = "unimplemented"
STATUSES = (IMPLEMENTED, CPU_NOOP, NOOP, UNIMPLEMENTED)

ENGINE = "engine"  # an EngineArgs field
SERVER = "server"  # a ServerConfig field
CLI = "cli"  # consumed by the command line itself (--config)

# vLLM's group names, in the order --help lists them, with what each holds
GROUPS: dict[str, str] = {
    "Frontend": "the HTTP server: address, TLS, CORS, API keys, chat templates, tool calling, plugins",
    "ModelConfig": "which model, its tokenizer, dtype, context length and generation defaults",
    "LoadConfig": "where weights come from and in which format",
    "StructuredOutputsConfig": "guided decoding (JSON schema, regex, choice, grammar) and reasoning parsing",
    "ParallelConfig": "tensor, pipeline and data parallelism and the executor that owns the workers",
    "CacheConfig": "the paged KV cache: block size, memory, prefix caching",
    "SchedulerConfig": "continuous batching: token budget, sequence cap, chunked prefill, policy",
    "DeviceConfig": "the device platform",
    "MultiModalConfig": "image, audio and video inputs",
    "LoRAConfig": "LoRA adapters",
    "PromptAdapterConfig": "prompt adapters",
    "SpeculativeConfig": "speculative decoding",
    "ObservabilityConfig": "tracing and metrics",
    "TokenizerPoolConfig": "asynchronous tokenizer pools (deprecated by vLLM)",
    "VllmConfig": "whole-engine JSON configs: compilation, KV transfer, speculative, structured outputs",
}


@dataclass(frozen=True)
class Flag:
    """One command-line flag of ``tokenloom serve``."""

    name: str  # "--max-model-len"
    group: str  # a key of GROUPS
    status: str  # one of STATUSES
    help: str = ""  # implemented flags default to their config field's docstring
    dest: str | None = None  # the EngineArgs / ServerConfig field an implemented flag sets
    to: str = ENGINE
    kind: str = "str"  # a key of CONVERTERS
    nargs: str | None = None  # "+" (one or more values) or "?" (an optional value)
    repeat: bool = False  # may be given several times; the values are collected in a list
    choices: tuple[Any, ...] | None = None
    default: Any = None  # flags that are not implemented: vLLM's default, accepted silently
    aliases: tuple[str, ...] = ()  # short forms: -tp, -pp, -q, -O ...
    negatable: bool = False  # has a --no-NAME form
    const: Any = None  # a bool flag that sets ``dest`` to this value when given
    note: str = ""  # why a noop is ignored, or what to use instead of an unimplemented flag
    tokenloom_only: bool = False  # not a vLLM flag: tokenloom's own

    @property
    def key(self) -> str:
        """The flag's own name as an identifier (``max_model_len``); several flags may share a dest."""
        return self.name[2:].replace("-", "_")

    @property
    def option_strings(self) -> tuple[str, ...]:
        negation = ("--no-" + self.name[2:],) if self.negatable else ()
        return (self.name, *self.aliases, *negation)

    @property
    def metavar(self) -> str | None:
        if self.kind == "bool":
            return None
        if self.choices:
            return "{" + ",".join(map(str, self.choices)) + "}"
        return self.key.upper()

    def converter(self) -> Callable[[str], Any]:
        return CONVERTERS[self.kind]


# -- value converters ------------------------------------------------------------------

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([kmgtKMGT]?)$")
_BOOL_WORDS = {"true": True, "yes": True, "1": True, "on": True, "false": False, "no": False, "0": False, "off": False}


def parse_size(text: str) -> int:
    """An integer, optionally human-readable as vLLM accepts it: ``1k`` = 1000, ``1K`` = 1024,
    ``25.6k`` = 25600 (lower-case suffixes are powers of 1000, upper-case of 1024)."""
    match = _SIZE.match(str(text).strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (suffixes k, m, g, t or K, M, G, T allowed)")
    number, suffix = match.groups()
    power = "kmgt".index(suffix.lower()) + 1 if suffix else 0
    value = float(number) * (1000 if suffix.islower() else 1024) ** power
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def parse_json_object(text: str) -> dict[str, Any]:
    """A JSON object given as text (``'{"factor": 2.0}'``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg} at character {exc.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object ({{...}}), got {text!r}")
    return value


def parse_str_list(text: str) -> list[str]:
    """A JSON list of strings (vLLM's form, ``'["a", "b"]'``) or a single string."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            value = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a valid JSON list ({exc.msg}): {text!r}") from None
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
        return value
    return [text]


def parse_level_or_json(text: str) -> int | dict[str, Any]:
    """An optimisation level (``3``) or a JSON object, as vLLM's ``-O`` takes."""
    return int(text) if text.strip().isdigit() else parse_json_object(text)


def parse_bool(text: str) -> bool:
    try:
        return _BOOL_WORDS[str(text).strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}") from None


CONVERTERS: dict[str, Callable[[str], Any]] = {
    "str": str,
    "int": int,
    "float": float,
    "size": parse_size,
    "json": parse_json_object,
    "strlist": parse_str_list,
    "bool": parse_bool,
    "level_or_json": parse_level_or_json,
}
JSON_KINDS = ("json", "level_or_json")  # kinds that also take vLLM's dotted form: --hf-overrides.key value


# -- constructors that keep the table below readable -------------------------------------


def implemented(name: str, group: str, dest: str | None = None, **options: Any) -> Flag:
    return Flag(name, group, IMPLEMENTED, dest=dest or name[2:].replace("-", "_"), **options)


def server(name: str, dest: str | None = None, **options: Any) -> Flag:
    return implemented(name, "Frontend", dest, to=SERVER, **options)


def cpu_noop(name: str, group: str, note: str, help: str, **options: Any) -> Flag:
    return Flag(name, group, CPU_NOOP, help=help, note=note, **options)


def noop(name: str, group: str, note: str, help: str, **options: Any) -> Flag:
    return Flag(name, group, NOOP, help=help, note=note, **options)


def unimplemented(name: str, group: str, help: str, **options: Any) -> Flag:
    return Flag(name, group, UNIMPLEMENTED, help=help, **options)


def _bool(**options: Any) -> dict[str, Any]:
    return {"kind": "bool", "negatable": True, "default": False, **options}


GPU_ONLY = "it concerns CUDA graphs or GPU kernels, which the CPU does not use"

FLAGS: tuple[Flag, ...] = (
    # -- Frontend: ServerConfig ------------------------------------------------------------
    implemented(
        "--config",
        "Frontend",
        to=CLI,
        help=(
            "A YAML file of flags: keys are flag names without the leading dashes (max-model-len or "
            "max_model_len). The command line wins over the file, the file over the defaults."
        ),
    ),
    server("--host"),
    server("--port", kind="int"),
    server("--uvicorn-log-level", choices=("critical", "error", "warning", "info", "debug", "trace")),
    server("--disable-uvicorn-access-log", kind="bool"),
    server("--api-key", repeat=True),
    server("--metrics-require-key", kind="bool", tokenloom_only=True),
    server("--allow-credentials", kind="bool"),
    server("--allowed-origins", kind="strlist"),
    server("--allowed-methods", kind="strlist"),
    server("--allowed-headers", kind="strlist"),
    server("--middleware", repeat=True),
    server("--root-path"),
    server("--ssl-keyfile"),
    server("--ssl-certfile"),
    server("--ssl-ca-certs"),
    server("--ssl-cert-reqs", kind="int"),
    unimplemented(
        "--enable-ssl-refresh",
        "Frontend",
        "Reload the TLS context when the certificate files change.",
        kind="bool",
        default=False,
    ),
    server("--disable-fastapi-docs", kind="bool"),
    server("--enable-request-id-headers", kind="bool"),
    server("--return-tokens-as-token-ids", kind="bool"),
    server("--max-log-len", kind="int"),
    noop(
        "--disable-log-requests",
        "Frontend",
        "deprecated by vLLM: requests are only logged with --enable-log-requests, off by default",
        "Deprecated by vLLM: requests are not logged unless --enable-log-requests is given.",
        kind="bool",
        default=False,
    ),
    server("--enable-log-requests", kind="bool"),
    server("--disable-log-stats", kind="bool"),
    server("--chat-template"),
    server("--chat-template-content-format", choices=("auto", "string", "openai")),
    server("--trust-request-chat-template", kind="bool"),
    server("--response-role"),
    server("--enable-auto-tool-choice", kind="bool"),
    server("--tool-call-parser"),
    server("--tool-parser-plugin", repeat=True),
    server(
        "--plugin",
        "plugins",
        repeat=True,
        tokenloom_only=True,
        help=("An importable module to load as a tokenloom plugin, besides the installed entry points (repeatable)."),
    ),
    server(
        "--strict-plugins",
        kind="bool",
        tokenloom_only=True,
        help=(
            "Refuse to start when an installed (entry-point) plugin fails to load, instead of starting "
            "without it and a warning. A --plugin or --tool-parser-plugin that fails is always fatal."
        ),
    ),
    server("--enable-prompt-tokens-details", kind="bool"),
    server("--enable-server-load-tracking", kind="bool"),
    noop(
        "--disable-frontend-multiprocessing",
        "Frontend",
        "tokenloom always runs the HTTP server and the engine in one process",
        "Run the HTTP server in the engine's process.",
        kind="bool",
        default=False,
    ),
    server("--max-request-body-bytes", kind="size", tokenloom_only=True),
    server("--responses-store-max-bytes", kind="size", tokenloom_only=True),
    server("--lora-modules", nargs="+"),
    unimplemented("--prompt-adapters", "Frontend", "Prompt adapters to serve, as name=path.", nargs="+"),
    server("--headless", kind="bool"),
    # -- ModelConfig ---------------------------------------------------------------------------
    implemented("--model", "ModelConfig"),
    implemented(
        "--task",
        "ModelConfig",
        choices=("auto", "generate", "embedding", "embed", "classify", "score", "reward", "transcription", "draft"),
    ),
    implemented("--runner", "ModelConfig", choices=("auto", "generate", "pooling", "draft")),
    implemented("--convert", "ModelConfig", choices=("auto", "none", "embed", "classify", "reward")),
    implemented("--tokenizer", "ModelConfig"),
    implemented("--tokenizer-mode", "ModelConfig", choices=("auto", "slow", "mistral", "custom")),
    implemented("--revision", "ModelConfig"),
    unimplemented(
        "--tokenizer-revision",
        "ModelConfig",
        "Revision of a tokenizer on the Hugging Face Hub.",
        note=(
            "--tokenizer takes a local directory, and the model's own tokenizer comes with its --revision; "
            "download the tokenizer revision and pass its directory to --tokenizer"
        ),
    ),
    implemented("--dtype", "ModelConfig", choices=("auto", "half", "float16", "bfloat16", "float", "float32")),
    implemented("--max-model-len", "ModelConfig", kind="size"),
    implemented("--served-model-name", "ModelConfig", nargs="+"),
    implemented("--seed", "ModelConfig", kind="int"),
    implemented("--hf-overrides", "ModelConfig", kind="json"),
    implemented("--rope-scaling", "ModelConfig", kind="json"),
    implemented("--rope-theta", "ModelConfig", kind="float"),
    noop(
        "--trust-remote-code",
        "ModelConfig",
        "tokenloom never runs code shipped with a model: architectures come from model plugins",
        "Trust (run) code shipped with a model.",
        **_bool(),
    ),
    implemented("--max-logprobs", "ModelConfig", kind="int"),
    implemented(
        "--logprobs-mode",
        "ModelConfig",
        choices=("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"),
    ),
    implemented("--skip-tokenizer-init", "ModelConfig", **_bool()),
    implemented("--generation-config", "ModelConfig"),
    noop(
        "--enforce-eager",
        "ModelConfig",
        "tokenloom always runs the model eagerly: it uses neither torch.compile nor CUDA graphs",
        "Run the model eagerly (no torch.compile, no CUDA graphs).",
        **_bool(),
    ),
    implemented("--override-pooler-config", "ModelConfig", kind="json"),
    implemented(
        "--pooler-config",
        "ModelConfig",
        "override_pooler_config",
        kind="json",
        help="JSON dict configuring the pooler of pooling models (vLLM's newer name of --override-pooler-config).",
    ),
    implemented("--disable-sliding-window", "ModelConfig", **_bool()),
    implemented("--quantization", "ModelConfig", aliases=("-q",)),
    unimplemented("--hf-config-path", "ModelConfig", "Name or path of a Hugging Face config to use instead."),
    unimplemented(
        "--hf-token",
        "ModelConfig",
        "Token for Hugging Face downloads.",
        nargs="?",
        note="the Hugging Face source reads the HF_TOKEN environment variable; set that instead",
    ),
    noop(
        "--code-revision",
        "ModelConfig",
        "tokenloom never runs model code shipped with a model",
        "Revision of the model code on the Hugging Face Hub.",
    ),
    unimplemented(
        "--config-format",
        "ModelConfig",
        "Format of the model config: auto, hf or mistral.",
        default="auto",
        choices=("auto", "hf", "mistral"),
    ),
    implemented("--mmproj", "ModelConfig", tokenloom_only=True),
    implemented("--model-impl", "ModelConfig", choices=("auto", "vllm", "native", "transformers", "terratorch")),
    implemented("--allowed-local-media-path", "ModelConfig", to=SERVER),
    implemented("--allowed-media-domains", "ModelConfig", nargs="+", to=SERVER),
    implemented("--logits-processor-pattern", "ModelConfig"),
    implemented("--logits-processors", "ModelConfig", nargs="+"),
    unimplemented("--io-processor-plugin", "ModelConfig", "An IOProcessor plugin to load at start-up."),
    unimplemented("--override-attention-dtype", "ModelConfig", "Run attention in another dtype."),
    implemented("--override-generation-config", "ModelConfig", kind="json"),
    unimplemented("--enable-prompt-embeds", "ModelConfig", "Accept prompt embeddings instead of token ids.", **_bool()),
    unimplemented("--quantization-param-path", "ModelConfig", "JSON file of KV-cache scaling factors (fp8)."),
    cpu_noop("--disable-cascade-attn", "ModelConfig", GPU_ONLY, "Disable cascade attention.", **_bool()),
    cpu_noop(
        "--enable-sleep-mode",
        "ModelConfig",
        "sleep mode frees GPU memory and exists only on CUDA",
        "Allow the engine to sleep and release device memory.",
        **_bool(),
    ),
    cpu_noop(
        "--max-seq-len-to-capture",
        "ModelConfig",
        GPU_ONLY,
        "Longest sequence covered by CUDA graphs.",
        kind="int",
        default=8192,
    ),
    cpu_noop(
        "--max-context-len-to-capture", "ModelConfig", GPU_ONLY, "Old name of --max-seq-len-to-capture.", kind="int"
    ),
    cpu_noop(
        "--override-neuron-config",
        "ModelConfig",
        "it configures AWS Neuron devices",
        "JSON dict of Neuron device settings.",
        kind="json",
    ),
    noop(
        "--disable-async-output-proc",
        "ModelConfig",
        "tokenloom has no asynchronous output processor to disable",
        "Disable asynchronous output processing.",
        kind="bool",
        default=False,
    ),
    # -- LoadConfig ------------------------------------------------------------------------------
    implemented("--load-format", "LoadConfig"),
    implemented("--download-dir", "LoadConfig"),
    implemented("--ignore-patterns", "LoadConfig", nargs="+"),
    implemented("--use-tqdm-on-load", "LoadConfig", **_bool(default=True)),
    unimplemented(
        "--model-loader-extra-config",
        "LoadConfig",
        "JSON dict of extra options for the model loader.",
        kind="json",
        note="no tokenloom load format takes extra options; a load-format plugin takes its own settings",
    ),
    unimplemented(
        "--pt-load-map-location",
        "LoadConfig",
        "map_location for torch.load of .pt/.bin weights.",
        default="cpu",
        note="weights are always loaded to the CPU first",
    ),
    unimplemented("--safetensors-load-strategy", "LoadConfig", "lazy (memory-mapped) or eager safetensors reads."),
    noop(
        "--qlora-adapter-name-or-path",
        "LoadConfig",
        "vLLM ignores it too and is removing it",
        "Name or path of a QLoRA adapter.",
    ),
    # -- StructuredOutputsConfig -----------------------------------------------------------------
    implemented("--guided-decoding-backend", "StructuredOutputsConfig"),
    implemented("--guided-decoding-disable-fallback", "StructuredOutputsConfig", **_bool()),
    implemented("--guided-decoding-disable-any-whitespace", "StructuredOutputsConfig", **_bool()),
    implemented("--guided-decoding-disable-additional-properties", "StructuredOutputsConfig", **_bool()),
    implemented("--reasoning-parser", "StructuredOutputsConfig"),
    implemented("--structured-outputs-compile-timeout", "StructuredOutputsConfig", kind="float", tokenloom_only=True),
    implemented("--structured-outputs-request-backends", "StructuredOutputsConfig", tokenloom_only=True),
    noop(
        "--enable-reasoning",
        "StructuredOutputsConfig",
        "reasoning is on whenever --reasoning-parser names a parser; vLLM deprecated it",
        "Old switch for reasoning_content; needs --reasoning-parser.",
        **_bool(),
    ),
    # -- ParallelConfig ---------------------------------------------------------------------------
    implemented("--distributed-executor-backend", "ParallelConfig"),
    implemented("--tensor-parallel-size", "ParallelConfig", kind="int", aliases=("-tp",), default=1),
    implemented("--pipeline-parallel-size", "ParallelConfig", kind="int", aliases=("-pp",), default=1),
    implemented("--data-parallel-size", "ParallelConfig", kind="int", aliases=("-dp",), default=1),
    implemented(
        "--worker-use-ray",
        "ParallelConfig",
        "distributed_executor_backend",
        kind="bool",
        const="ray",
        help="Old spelling of --distributed-executor-backend ray.",
        note="deprecated by vLLM: use --distributed-executor-backend ray",
    ),
    implemented("--data-parallel-size-local", "ParallelConfig", kind="int", aliases=("-dpl",)),
    implemented("--data-parallel-address", "ParallelConfig", aliases=("-dpa",)),
    implemented("--data-parallel-rpc-port", "ParallelConfig", kind="int", aliases=("-dpp",)),
    implemented("--data-parallel-start-rank", "ParallelConfig", kind="int", aliases=("-dpr",)),
    implemented("--data-parallel-rank", "ParallelConfig", kind="int", aliases=("-dpn",)),
    implemented("--data-parallel-backend", "ParallelConfig", aliases=("-dpb",), default="mp", choices=("mp", "ray")),
    implemented("--data-parallel-hybrid-lb", "ParallelConfig", kind="bool", negatable=True),
    implemented("--nnodes", "ParallelConfig", kind="int", default=1),
    implemented("--node-rank", "ParallelConfig", kind="int", default=0),
    implemented("--master-addr", "ParallelConfig", default="127.0.0.1"),
    implemented("--master-port", "ParallelConfig", kind="int", default=29501),
    unimplemented(
        "--decode-context-parallel-size",
        "ParallelConfig",
        "Decode context-parallel groups.",
        kind="int",
        aliases=("-dcp",),
        default=1,
    ),
    unimplemented("--enable-expert-parallel", "ParallelConfig", "Expert parallelism for MoE layers.", **_bool()),
    unimplemented("--enable-eplb", "ParallelConfig", "Expert-parallel load balancing.", **_bool()),
    unimplemented("--eplb-config", "ParallelConfig", "JSON expert-parallel load-balancing settings.", kind="json"),
    unimplemented("--eplb-log-balancedness", "ParallelConfig", "Log expert load balance.", **_bool()),
    unimplemented("--eplb-step-interval", "ParallelConfig", "Steps between expert rebalancing.", kind="int"),
    unimplemented("--eplb-window-size", "ParallelConfig", "Window of expert-load statistics.", kind="int"),
    unimplemented("--num-redundant-experts", "ParallelConfig", "Redundant experts for load balancing.", kind="int"),
    unimplemented(
        "--expert-placement-strategy",
        "ParallelConfig",
        "How MoE experts are placed on ranks.",
        choices=("linear", "round_robin"),
        default="linear",
    ),
    unimplemented("--enable-dbo", "ParallelConfig", "Dual-batch overlap.", **_bool()),
    unimplemented(
        "--dbo-decode-token-threshold",
        "ParallelConfig",
        "Dual-batch-overlap threshold for decodes.",
        kind="int",
        default=32,
    ),
    unimplemented(
        "--dbo-prefill-token-threshold",
        "ParallelConfig",
        "Dual-batch-overlap threshold for prefills.",
        kind="int",
        default=512,
    ),
    unimplemented(
        "--enable-multimodal-encoder-data-parallel",
        "ParallelConfig",
        "Data-parallel multimodal encoders.",
        kind="bool",
        default=False,
    ),
    unimplemented(
        "--worker-cls",
        "ParallelConfig",
        "Worker class to run.",
        default="auto",
        note=(
            "tokenloom's worker is not a public interface that another class could honestly stand in for; "
            "what owns and runs the workers is: register an executor with register_executors and pick it "
            "with --distributed-executor-backend"
        ),
    ),
    unimplemented("--worker-extension-cls", "ParallelConfig", "Class mixed into the worker.", default=""),
    cpu_noop(
        "--disable-custom-all-reduce",
        "ParallelConfig",
        GPU_ONLY,
        "Use NCCL instead of the custom all-reduce kernel.",
        **_bool(),
    ),
    cpu_noop(
        "--ray-workers-use-nsight",
        "ParallelConfig",
        "Nsight profiles NVIDIA GPUs",
        "Profile Ray workers with Nsight.",
        **_bool(),
    ),
    noop(
        "--max-parallel-loading-workers",
        "ParallelConfig",
        "weights are streamed one tensor at a time, so loading needs no batching",
        "Load weights in batches of this many workers.",
        kind="int",
    ),
    # -- CacheConfig ---------------------------------------------------------------------------
    implemented("--block-size", "CacheConfig", kind="int"),
    implemented("--gpu-memory-utilization", "CacheConfig", kind="float"),
    implemented("--kv-cache-memory-bytes", "CacheConfig", kind="size"),
    implemented("--num-gpu-blocks-override", "CacheConfig", kind="int"),
    implemented("--enable-prefix-caching", "CacheConfig", **_bool(default=True)),
    implemented("--prefix-caching-hash-algo", "CacheConfig", choices=("builtin", "sha256")),
    implemented(
        "--kv-cache-dtype",
        "CacheConfig",
        "cache_dtype",
        choices=("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"),
    ),
    implemented("--calculate-kv-scales", "CacheConfig", **_bool()),
    unimplemented("--kv-sharing-fast-prefill", "CacheConfig", "Skip prefill tokens in KV-sharing layers.", **_bool()),
    unimplemented(
        "--mamba-cache-dtype",
        "CacheConfig",
        "Data type of Mamba state caches.",
        choices=("auto", "float32"),
        default="auto",
    ),
    unimplemented(
        "--mamba-ssm-cache-dtype",
        "CacheConfig",
        "Data type of the Mamba SSM state.",
        choices=("auto", "float32"),
        default="auto",
    ),
    cpu_noop(
        "--swap-space",
        "CacheConfig",
        "it is host memory for blocks swapped out of a GPU",
        "CPU swap space per GPU, in GiB.",
        kind="float",
        default=4,
    ),
    cpu_noop(
        "--cpu-offload-gb",
        "CacheConfig",
        "the weights already live in CPU memory",
        "GiB of weights to keep in CPU memory per GPU.",
        kind="float",
        default=0,
    ),
    # -- SchedulerConfig -----------------------------------------------------------------------
    implemented("--max-num-batched-tokens", "SchedulerConfig", kind="size"),
    implemented("--max-num-seqs", "SchedulerConfig", kind="int"),
    implemented("--enable-chunked-prefill", "SchedulerConfig", **_bool(default=True)),
    implemented("--max-num-partial-prefills", "SchedulerConfig", kind="int"),
    implemented("--long-prefill-token-threshold", "SchedulerConfig", kind="int"),
    implemented("--scheduling-policy", "SchedulerConfig", choices=("fcfs", "priority")),
    implemented("--max-waiting-requests", "SchedulerConfig", kind="int", tokenloom_only=True),
    unimplemented(
        "--max-long-partial-prefills",
        "SchedulerConfig",
        "Long prompts prefilled in chunks at once.",
        kind="int",
        default=1,
    ),
    unimplemented(
        "--num-lookahead-slots",
        "SchedulerConfig",
        "Extra KV slots per step for speculative tokens.",
        kind="int",
        default=0,
    ),
    unimplemented(
        "--scheduler-cls",
        "SchedulerConfig",
        "Scheduler class to use.",
        default="vllm.core.scheduler.Scheduler",
        note=(
            "the engine drives its scheduler through more than a documented interface (queues, block "
            "manager, preemption, pooling admission), so no other class could honour it yet; use "
            "--scheduling-policy fcfs|priority"
        ),
    ),
    unimplemented(
        "--num-scheduler-steps",
        "SchedulerConfig",
        "Forward steps per scheduler call (multi-step).",
        kind="int",
        default=1,
    ),
    unimplemented(
        "--scheduler-delay-factor",
        "SchedulerConfig",
        "Delay before scheduling the next prompt.",
        kind="float",
        default=0.0,
    ),
    unimplemented(
        "--preemption-mode",
        "SchedulerConfig",
        "Preempt by recompute or swap.",
        choices=("recompute", "swap"),
        default="recompute",
        note="tokenloom preempts by recompute",
    ),
    unimplemented("--async-scheduling", "SchedulerConfig", "Schedule the next step while this one runs.", **_bool()),
    unimplemented("--disable-chunked-mm-input", "SchedulerConfig", "Never split a multimodal item.", **_bool()),
    unimplemented(
        "--disable-hybrid-kv-cache-manager", "SchedulerConfig", "Same KV size for every attention type.", **_bool()
    ),
    cpu_noop(
        "--cuda-graph-sizes",
        "SchedulerConfig",
        GPU_ONLY,
        "Batch sizes to capture CUDA graphs for.",
        kind="int",
        nargs="+",
    ),
    noop(
        "--multi-step-stream-outputs",
        "SchedulerConfig",
        "it only applies to multi-step scheduling",
        "Stream outputs after every step of a multi-step call.",
        **_bool(default=True),
    ),
    noop(
        "--use-v2-block-manager",
        "SchedulerConfig",
        "vLLM ignores it too: one block manager remains",
        "Old switch for the v2 block manager.",
        kind="bool",
        default=False,
    ),
    # -- DeviceConfig ---------------------------------------------------------------------------
    implemented("--device", "DeviceConfig"),
    implemented("--attention-backend", "DeviceConfig"),
    # -- MultiModalConfig -----------------------------------------------------------------------
    implemented("--limit-mm-per-prompt", "MultiModalConfig", kind="json", to=SERVER),
    implemented("--mm-processor-kwargs", "MultiModalConfig", kind="json", to=SERVER),
    implemented("--enable-mm-embeds", "MultiModalConfig", kind="bool", negatable=True, to=SERVER),
    unimplemented(
        "--mm-processor-cache-gb",
        "MultiModalConfig",
        "Size of the multimodal processor cache.",
        kind="float",
        default=4,
    ),
    unimplemented(
        "--mm-processor-cache-type",
        "MultiModalConfig",
        "lru or shm processor cache.",
        choices=("lru", "shm"),
        default="lru",
    ),
    unimplemented(
        "--mm-shm-cache-max-object-size-mb",
        "MultiModalConfig",
        "Largest object in the shm cache.",
        kind="int",
        default=128,
    ),
    unimplemented(
        "--mm-encoder-tp-mode",
        "MultiModalConfig",
        "How the vision encoder uses tensor parallelism.",
        choices=("data", "weights"),
        default="weights",
    ),
    unimplemented(
        "--mm-cache-preprocessor",
        "MultiModalConfig",
        "Cache the multimodal preprocessor output.",
        kind="bool",
        default=False,
    ),
    unimplemented("--disable-mm-preprocessor-cache", "MultiModalConfig", "Do not cache processed media.", **_bool()),
    unimplemented(
        "--interleave-mm-strings", "MultiModalConfig", "Interleave media and text in string content.", **_bool()
    ),
    unimplemented("--media-io-kwargs", "MultiModalConfig", "Options for decoding media, per modality.", kind="json"),
    unimplemented(
        "--skip-mm-profiling", "MultiModalConfig", "Skip memory profiling of multimodal encoders.", **_bool()
    ),
    unimplemented("--video-pruning-rate", "MultiModalConfig", "Fraction of video tokens to prune.", kind="float"),
    # -- LoRAConfig ------------------------------------------------------------------------------
    implemented("--enable-lora", "LoRAConfig", **_bool()),
    unimplemented("--enable-lora-bias", "LoRAConfig", "LoRA adapters with biases.", **_bool()),
    noop(
        "--fully-sharded-loras",
        "LoRAConfig",
        "it splits LoRA matmuls across tensor-parallel ranks, and tokenloom runs LoRA on one rank",
        "Shard all LoRA computation.",
        **_bool(),
    ),
    implemented("--max-loras", "LoRAConfig", kind="int"),
    implemented("--max-lora-rank", "LoRAConfig", kind="int"),
    unimplemented("--lora-extra-vocab-size", "LoRAConfig", "Extra vocabulary a LoRA may add.", kind="int", default=256),
    implemented("--lora-dtype", "LoRAConfig", choices=("auto", "float16", "bfloat16", "float32")),
    unimplemented(
        "--long-lora-scaling-factors", "LoRAConfig", "Scaling factors of long-context LoRAs.", kind="float", nargs="+"
    ),
    implemented("--max-cpu-loras", "LoRAConfig", kind="int"),
    unimplemented("--default-mm-loras", "LoRAConfig", "LoRA to apply per input modality.", kind="json"),
    # -- PromptAdapterConfig ---------------------------------------------------------------------
    unimplemented("--enable-prompt-adapter", "PromptAdapterConfig", "Serve prompt adapters.", **_bool()),
    unimplemented(
        "--max-prompt-adapters", "PromptAdapterConfig", "Prompt adapters in one batch.", kind="int", default=1
    ),
    unimplemented(
        "--max-prompt-adapter-token", "PromptAdapterConfig", "Tokens per prompt adapter.", kind="int", default=0
    ),
    # -- SpeculativeConfig ------------------------------------------------------------------------
    implemented(
        "--speculative-model",
        "SpeculativeConfig",
        to=CLI,
        help='Older form of --speculative-config: "[ngram]" for prompt lookup, else a draft model.',
    ),
    implemented(
        "--speculative-model-quantization",
        "SpeculativeConfig",
        to=CLI,
        help="Older form of --speculative-config's quantization: the draft model's.",
    ),
    implemented(
        "--num-speculative-tokens",
        "SpeculativeConfig",
        to=CLI,
        kind="int",
        help="Older form of --speculative-config's num_speculative_tokens: draft tokens per step.",
    ),
    unimplemented(
        "--speculative-disable-mqa-scorer",
        "SpeculativeConfig",
        "Score drafts by batch expansion.",
        kind="bool",
        default=False,
    ),
    implemented(
        "--speculative-draft-tensor-parallel-size",
        "SpeculativeConfig",
        to=CLI,
        kind="int",
        aliases=("-spec-draft-tp",),
        help="Tensor-parallel size of the draft model; only 1 (the draft runs in the target's worker).",
    ),
    implemented(
        "--speculative-max-model-len",
        "SpeculativeConfig",
        to=CLI,
        kind="int",
        help="Older form of --speculative-config's max_model_len: the draft model's context length.",
    ),
    implemented(
        "--speculative-disable-by-batch-size",
        "SpeculativeConfig",
        to=CLI,
        kind="int",
        help="Older form of --speculative-config's disable_by_batch_size: no drafts above this many requests.",
    ),
    implemented(
        "--ngram-prompt-lookup-max",
        "SpeculativeConfig",
        to=CLI,
        kind="int",
        help="Older form of --speculative-config's prompt_lookup_max: the longest n-gram looked up.",
    ),
    implemented(
        "--ngram-prompt-lookup-min",
        "SpeculativeConfig",
        to=CLI,
        kind="int",
        help="Older form of --speculative-config's prompt_lookup_min: the shortest n-gram looked up.",
    ),
    implemented(
        "--spec-decoding-acceptance-method",
        "SpeculativeConfig",
        to=CLI,
        choices=("rejection_sampler", "typical_acceptance_sampler"),
        help="How drafts are accepted; only rejection_sampler, which keeps the target distribution exactly.",
    ),
    unimplemented(
        "--typical-acceptance-sampler-posterior-threshold",
        "SpeculativeConfig",
        "Posterior threshold of the typical acceptance sampler.",
        kind="float",
    ),
    unimplemented(
        "--typical-acceptance-sampler-posterior-alpha",
        "SpeculativeConfig",
        "Entropy scaling of the typical acceptance sampler.",
        kind="float",
    ),
    noop(
        "--disable-logprobs-during-spec-decoding",
        "SpeculativeConfig",
        "the logprobs a request asks for are always returned while speculating, computed by the target model",
        "Accepted for vLLM compatibility, with a warning: logprobs asked for are always returned while speculating.",
        kind="bool",
        default=False,
    ),
    # -- ObservabilityConfig ----------------------------------------------------------------------
    implemented("--otlp-traces-endpoint", "ObservabilityConfig", to=SERVER),
    implemented(
        "--collect-detailed-traces",
        "ObservabilityConfig",
        to=SERVER,
        nargs="+",
        help="Modules to trace in detail: model, worker or all (several, or comma-separated).",
    ),
    noop(
        "--show-hidden-metrics-for-version",
        "ObservabilityConfig",
        "tokenloom hides no deprecated metrics",
        "Show metrics deprecated since this version.",
    ),
    # -- TokenizerPoolConfig (deprecated by vLLM: no effect) ------------------------------------------
    noop(
        "--tokenizer-pool-size",
        "TokenizerPoolConfig",
        "vLLM deprecated it and ignores it too",
        "Size of an asynchronous tokenizer pool.",
        kind="int",
        default=0,
    ),
    noop(
        "--tokenizer-pool-type",
        "TokenizerPoolConfig",
        "vLLM deprecated it and ignores it too",
        "Type of the tokenizer pool.",
        default="ray",
    ),
    noop(
        "--tokenizer-pool-extra-config",
        "TokenizerPoolConfig",
        "vLLM deprecated it and ignores it too",
        "Extra tokenizer pool settings.",
        kind="json",
    ),
    # -- VllmConfig: whole-engine JSON configs ------------------------------------------------------
    implemented(
        "--structured-outputs-config",
        "VllmConfig",
        to=CLI,
        kind="json",
        help=(
            "JSON structured-outputs settings (vLLM's newer form of the --guided-decoding-* flags): "
            "backend, disable_fallback, disable_any_whitespace, disable_additional_properties, "
            "reasoning_parser."
        ),
    ),
    implemented(
        "--speculative-config",
        "VllmConfig",
        to=CLI,
        kind="json",
        help=(
            "JSON speculative-decoding settings, vLLM's keys: method (ngram, draft_model, or a proposer "
            "plugin), num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, disable_by_batch_size; "
            "for draft_model: model, quantization, max_model_len; adaptive_num_speculative_tokens (default true: "
            "each request drafts 1..num_speculative_tokens as its acceptance pays for; false: always "
            "num_speculative_tokens) and verify_row_cost (one more verified token's time as a fraction of a "
            "decode step; default: the platform's). "
            "The older --speculative-model / --num-speculative-tokens / --ngram-prompt-lookup-* flags map onto it."
        ),
    ),
    implemented(
        "--kv-transfer-config",
        "VllmConfig",
        to=CLI,
        kind="json",
        help=(
            "JSON KV-connector settings, vLLM's keys: kv_connector (a register_kv_connectors name, e.g. "
            "SharedStorageConnector), kv_role (kv_producer: store computed prefix blocks; kv_consumer: load them; "
            "kv_both, the default) and kv_connector_extra_config (the connector's options; SharedStorageConnector: "
            "shared_storage_path, max_bytes). A new request's prefix beyond the local prefix cache is loaded from "
            "the connector, so a prompt prefilled by another instance, or before a restart, is not recomputed."
        ),
    ),
    implemented(
        "--kv-events-config",
        "VllmConfig",
        to=CLI,
        kind="json",
        help=(
            "JSON KV-cache event settings, vLLM's keys: enable_kv_cache_events, publisher (zmq or null), "
            "endpoint (default tcp://*:5557), replay_endpoint, buffer_steps, hwm, max_queue_size, topic. "
            "Publishes vLLM's BlockStored, BlockRemoved and AllBlocksCleared batches (msgpack over ZMQ) as the "
            "prefix cache changes; with -dp, replica r on the ports plus r. Needs pip install 'tokenloom[kv-events]'."
        ),
    ),
    unimplemented("--additional-config", "VllmConfig", "JSON settings for the platform plugin.", kind="json"),
    cpu_noop(
        "--compilation-config",
        "VllmConfig",
        "its levels and CUDA-graph sizes concern GPU compilation; tokenloom runs the model eagerly",
        "torch.compile and CUDA-graph settings, or an optimisation level (-O3).",
        aliases=("-O",),
        kind="level_or_json",
    ),
)

FLAG_BY_NAME: dict[str, Flag] = {}
for _flag in FLAGS:
    for _option in _flag.option_strings:
        FLAG_BY_NAME[_option] = _flag
FLAG_BY_KEY: dict[str, Flag] = {flag.key: flag for flag in FLAGS}

# --structured-outputs-config keys -> the engine arguments they set
STRUCTURED_OUTPUTS_KEYS = {
    "backend": "guided_decoding_backend",
    "disable_fallback": "guided_decoding_disable_fallback",
    "disable_any_whitespace": "guided_decoding_disable_any_whitespace",
    "disable_additional_properties": "guided_decoding_disable_additional_properties",
    "reasoning_parser": "reasoning_parser",
}


# the older individual speculative-decoding flags -> the --speculative-config keys they set
SPECULATIVE_FLAG_KEYS = {
    "speculative_model": "model",
    "speculative_model_quantization": "quantization",
    "num_speculative_tokens": "num_speculative_tokens",
    "speculative_draft_tensor_parallel_size": "draft_tensor_parallel_size",
    "speculative_max_model_len": "max_model_len",
    "speculative_disable_by_batch_size": "disable_by_batch_size",
    "ngram_prompt_lookup_max": "prompt_lookup_max",
    "ngram_prompt_lookup_min": "prompt_lookup_min",
    "spec_decoding_acceptance_method": "acceptance_method",
}


def flags_in_group(group: str) -> list[Flag]:
    return [flag for flag in FLAGS if flag.group == group]


# -- help texts and defaults of implemented flags come from the config dataclasses ------------


@cache
def _field_docs(cls: type) -> dict[str, str]:
    """field -> attribute docstring, for one config dataclass."""
    node = next(n for n in ast.parse(textwrap.dedent(inspect.getsource(cls))).body if isinstance(n, ast.ClassDef))
    fields: dict[str, str] = {}
    for statement, following in zip(node.body, node.body[1:]):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            fields[statement.target.id] = " ".join(following.value.value.split())
    return fields


def _config_class(flag: Flag) -> type | None:
    from tokenloom.api.server_config import ServerConfig
    from tokenloom.core import config

    if flag.to == SERVER:
        return ServerConfig
    if flag.to != ENGINE or flag.dest is None:
        return None
    if flag.dest in config.STRUCTURED_OUTPUT_ARGS:
        return config.StructuredOutputConfig
    group = config.ENGINE_ARG_GROUPS.get(flag.dest)
    return dict(config.CONFIG_GROUPS).get(group) if group else None


def _config_field_name(flag: Flag) -> str | None:
    from tokenloom.core.config import STRUCTURED_OUTPUT_ARGS

    if flag.dest is None:
        return None
    return STRUCTURED_OUTPUT_ARGS.get(flag.dest, flag.dest) if flag.to == ENGINE else flag.dest


def help_text(flag: Flag) -> str:
    """The flag's help: its own text, else its config field's docstring."""
    if flag.help:
        return flag.help
    cls = _config_class(flag)
    if cls is None:
        return ""
    # the docstrings are reStructuredText: ``literal`` reads as literal on a terminal
    return _field_docs(cls).get(_config_field_name(flag) or "", "").replace("``", "")


def default_value(flag: Flag) -> Any:
    """What the flag's value is when it is not given."""
    cls = _config_class(flag)
    if cls is None or flag.const is not None:
        return flag.default
    for config_field in dataclasses.fields(cls):
        if config_field.name == _config_field_name(flag):
            if config_field.default_factory is not dataclasses.MISSING:
                return config_field.default_factory()
            return config_field.default
    return flag.default


def check_catalogue() -> None:
    """Every implemented flag lands on a field that exists; raises ConfigError naming the flag."""
    from tokenloom.api.server_config import ServerConfig
    from tokenloom.core.config import ENGINE_ARG_GROUPS, STRUCTURED_OUTPUT_ARGS

    server_fields = {f.name for f in dataclasses.fields(ServerConfig)}
    for flag in FLAGS:
        if flag.group not in GROUPS or flag.status not in STATUSES:
            raise ConfigError(f"{flag.name}: unknown group {flag.group!r} or status {flag.status!r}")
        if flag.status != IMPLEMENTED or flag.to == CLI:
            continue
        fields = server_fields if flag.to == SERVER else set(ENGINE_ARG_GROUPS) | set(STRUCTURED_OUTPUT_ARGS)
        if flag.dest not in fields:
            raise ConfigError(f"{flag.name} maps to {flag.to} field {flag.dest!r}, which does not exist")
