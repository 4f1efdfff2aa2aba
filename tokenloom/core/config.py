"""Typed engine configuration: one dataclass per concern, and :class:`EngineArgs`, the flat
set of engine arguments by their vLLM names (``LLM(**kwargs)`` and the CLI map onto it).

Attribute docstrings (the string literal under each field) are the CLI help texts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any

from tokenloom.core.kv_transfer_config import KVTransferConfig
from tokenloom.errors import ConfigError

DTYPE_CHOICES = ("auto", "half", "float16", "bfloat16", "float", "float32")
# --model-impl: vLLM's names (its ``terratorch`` is refused), plus ``native`` for ``vllm``
MODEL_IMPL_CHOICES = ("auto", "vllm", "native", "transformers")


@dataclass
class ModelConfig:
    model: str = "smollm2"
    """Name or path of the model: a local directory, a .gguf file, a Hugging Face repo id, or
    the short name of a model shipped in a pip package (``smollm2``, ``gemma3-270m``,
    ``all-minilm-l6-v2``)."""
    tokenizer: str | None = None
    """Name or path of the tokenizer; defaults to the model's."""
    tokenizer_mode: str = "auto"
    """``auto`` uses the fast tokenizer when there is one, ``slow`` forces the slow one
    (``mistral`` and ``custom`` are refused: tokenloom reads Hugging Face and GGUF
    tokenizers only)."""
    revision: str | None = None
    """The model revision (branch, tag or commit) on the Hugging Face Hub."""
    tokenizer_revision: str | None = None
    """The tokenizer revision on the Hugging Face Hub."""
    dtype: str = "auto"
    """Data type of weights and activations: auto, half/float16, bfloat16, float/float32.
    ``auto`` takes the platform's default for the model's dtype."""
    max_model_len: int | None = None
    """Model context length (prompt plus output); defaults to the model's own."""
    served_model_name: list[str] | None = None
    """The model name(s) the API answers to; the first is reported. Defaults to ``--model``."""
    seed: int | None = 0
    """Random seed for weight initialisation (dummy weights) and unseeded sampling: two engines
    started with the same seed sample the same tokens for the same sequence of requests."""
    hf_overrides: dict[str, Any] | None = None
    """JSON dict of values to override in the model's Hugging Face config."""
    rope_scaling: dict[str, Any] | None = None
    """JSON dict of RoPE scaling settings, e.g. ``{"rope_type": "linear", "factor": 2.0}``."""
    rope_theta: float | None = None
    """RoPE theta; overrides the model's."""
    trust_remote_code: bool = False
    """Accepted for compatibility; tokenloom never runs model code from the model's files."""
    max_logprobs: int = 20
    """Maximum number of log probabilities to return per token (logprobs, prompt_logprobs);
    -1: no cap (up to the whole vocabulary)."""
    logprobs_mode: str = "raw_logprobs"
    """What logprobs hold: raw_logprobs, processed_logprobs, raw_logits, processed_logits."""
    skip_tokenizer_init: bool = False
    """Run without a tokenizer: prompts must be token ids (/v1/completions), outputs are token
    ids (``return_token_ids``) with empty text; text prompts, chat and /tokenize get a 400."""
    generation_config: str = "auto"
    """Where request defaults come from: ``auto`` reads the model's generation_config.json
    (or a GGUF's general.sampling.* keys), ``vllm`` ignores them, a folder path reads its
    generation_config.json. They set temperature, top_p, top_k, min_p and repetition_penalty
    for requests that leave them unset, and max_new_tokens caps every request's max_tokens."""
    override_generation_config: dict[str, Any] | None = None
    """JSON dict of generation defaults applied over --generation-config's, by their
    generation_config.json names, e.g. ``{"temperature": 0.5, "max_new_tokens": 256}``."""
    enforce_eager: bool = False
    """Accepted for compatibility: tokenloom always runs the model eagerly (no torch.compile,
    no CUDA graphs)."""
    task: str = "auto"
    """Deprecated vLLM name for the runner: auto, generate, embed, score, classify, reward."""
    runner: str = "auto"
    """auto, generate or pooling."""
    convert: str = "auto"
    """Adapt a model to another task: auto, none, embed, classify, reward."""
    override_pooler_config: dict[str, Any] | None = None
    """JSON dict overriding the pooler (pooling_type, normalize, softmax)."""
    disable_sliding_window: bool = False
    """Disable sliding-window attention, capping the context at the window."""
    model_impl: str = "auto"
    """Which implementation runs the model: ``auto`` takes tokenloom's native model plugin for
    the architecture and, where none is registered, transformers' own modeling code with
    tokenloom's paged attention (the Transformers fallback: decoder-only causal LMs whose
    attention goes through transformers' attention interface; one worker, no LoRA); ``vllm``
    (or ``native``) only a native plugin; ``transformers`` the fallback even where a native
    plugin exists. ``terratorch`` is refused."""
    quantization: str | None = None
    """Quantization method of the weights; default is what the model's files need."""
    logits_processors: list[str] | None = None
    """Logits processors applied to every request, built with no arguments: registered names
    (the register_logits_processors hook) or import paths (``pkg.mod.Class`` or
    ``pkg.mod:Class``) of a class, factory or function
    ``fn(prompt_token_ids, output_token_ids, logits) -> logits``."""
    logits_processor_pattern: str | None = None
    """Regex of qualified names (``pkg.mod.Class``) that a request's ``logits_processors`` may
    import and run; the whole name must match (``my_pkg\\.processors\\..*``), and it must name a
    class or function defined in that module. Unset, requests may name only registered
    processors."""


@dataclass
class CacheConfig:
    block_size: int = 16
    """Tokens per KV-cache block."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the device's memory the engine may use: on a GPU, of its total memory, for
    weights, activations and KV cache together (as in vLLM); on the CPU, of available RAM for
    the KV cache (capped at 4 GiB unless ``--kv-cache-memory-bytes`` is given)."""
    kv_cache_memory_bytes: int | None = None
    """Bytes of memory for the KV cache; overrides the utilization-based size."""
    num_gpu_blocks_override: int | None = None
    """Exact number of KV-cache blocks (testing, preemption experiments)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes (on by default, as in vLLM v1)."""
    prefix_caching_hash_algo: str = "sha256"
    """Hash of prefix-cache keys: sha256 (collision resistant, the default) or builtin
    (Python's hash(): a little faster, but a crafted collision is easy; every hit is still
    checked against the block's token ids, so a collision costs a miss, never another
    request's KV)."""
    cache_dtype: str = "auto"
    """KV-cache data type: ``auto`` (the model's dtype), ``bfloat16``, or an 8-bit float
    cache holding twice the tokens in the same memory: ``fp8`` (= ``fp8_e4m3``) or
    ``fp8_e5m2``, scaled per layer by k_scale/v_scale (1.0, or see
    ``--calculate-kv-scales``). ``fp8_inc`` (Intel Gaudi) is refused."""
    calculate_kv_scales: bool = False
    """With an fp8 KV cache: set each layer's k_scale and v_scale from the first step's keys
    and values (max |k| / 200, max |v| / 100, as vLLM) instead of 1.0."""


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int | None = None
    """Token budget per step (prefill and decode tokens together); default 2048."""
    max_num_seqs: int = 256
    """Maximum number of sequences in a step."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so prefill and decode share each step."""
    max_num_partial_prefills: int = 1
    """Maximum number of prompts being prefilled in chunks at once."""
    long_prefill_token_threshold: int = 0
    """Tokens above which a prompt counts as long (0: derived from the model length)."""
    scheduling_policy: str = "fcfs"
    """fcfs (first come, first served) or priority (lower ``priority`` value first, then
    arrival)."""
    max_waiting_requests: int | None = 1024
    """Refuse new requests with 429 (and Retry-After) when this many sequences wait to be
    scheduled (an ``n`` > 1 request counts ``n``); bounds the memory a burst can take.
    0 or less: unlimited."""


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Number of tensor-parallel ranks (one worker process each)."""
    pipeline_parallel_size: int = 1
    """Number of pipeline stages (one worker process per stage and tensor-parallel rank)."""
    data_parallel_size: int = 1
    """Number of data-parallel replicas: full engines (each with its own scheduler, executor
    and KV cache) behind one API server, requests balanced by load."""
    data_parallel_size_local: int | None = None
    """Data-parallel replicas to run on this node (the rest on other nodes of the Ray cluster,
    ``--data-parallel-backend ray`` only); unset: all of them under ``mp``, wherever Ray places
    them under ``ray``."""
    data_parallel_backend: str = "mp"
    """Where data-parallel replicas run: ``mp`` (one process each on this machine) or ``ray``
    (one Ray actor each, on the cluster ``RAY_ADDRESS`` names or a local Ray)."""
    data_parallel_rank: int = 0
    """This engine's rank among the data-parallel replicas (``-dp`` sets it per replica): its
    KV-cache event batches carry it, and its event endpoints' ports are offset by it."""
    distributed_executor_backend: str | None = None
    """Executor plugin that owns the workers: ``uni`` (one worker in the engine's process),
    ``mp`` (worker processes on this machine) or ``ray`` (Ray actors, across machines); by
    default ``mp`` when ``tp * pp > 1``, else ``uni``."""

    @property
    def world_size(self) -> int:
        """Workers of one engine: ``tp * pp``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class DeviceConfig:
    device: str = "auto"
    """Device platform plugin; ``auto`` picks the available one of highest priority (a GPU
    before the CPU)."""
    attention_backend: str = "auto"
    """Paged attention backend: auto (the platform's choice), torch, cpu_native, reference or
    triton (on the CPU only under TRITON_INTERPRET=1); vLLM's names (TORCH_SDPA, TRITON_ATTN)
    are accepted. Unset, the TOKENLOOM_ATTENTION_BACKEND or VLLM_ATTENTION_BACKEND environment
    variable decides."""


@dataclass
class LoadConfig:
    load_format: str = "auto"
    """Weight format plugin: auto, safetensors, pt, gguf, dummy, or one a plugin adds."""
    download_dir: str | None = None
    """Directory to download and cache Hugging Face models in."""
    ignore_patterns: list[str] | None = None
    """Glob patterns of model files not to load (e.g. ``original/**/*``)."""
    use_tqdm_on_load: bool = True
    """Show a progress bar while loading weights."""
    model_loader_extra_config: dict[str, Any] | None = None
    """Extra options for the load format plugin."""


@dataclass
class StructuredOutputConfig:
    backend: str = "auto"
    """Default guided-decoding backend; ``auto`` picks per request. vLLM's option syntax
    (``xgrammar:disable-any-whitespace``) is accepted."""
    disable_fallback: bool = False
    """Do not fall back to another backend when the chosen one cannot express a request."""
    disable_any_whitespace: bool = False
    """Generate JSON without optional whitespace."""
    disable_additional_properties: bool = False
    """Treat JSON schemas as if ``additionalProperties: false``."""
    reasoning_parser: str | None = None
    """The reasoning parser, so constraints start after the reasoning section."""
    compile_timeout: float = 30.0
    """Seconds one guided-decoding constraint may take to compile; a slower one (say a JSON
    schema with a huge maxLength) fails its request with a 400 and the compile pool goes on
    with a fresh thread."""
    request_backends: str = "any"
    """Which guided-decoding backends a request may choose (``backend`` in
    ``structured_outputs``, or ``guided_decoding_backend``): ``any``; ``none``, only the server's
    own backend (vLLM's behaviour: a request naming another gets a 400); or a comma-separated
    list of backend names it may name besides the server's."""


LORA_DTYPE_CHOICES = ("auto", "float16", "bfloat16", "float32")


@dataclass
class LoRAConfig:
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT format) beside the base model: requests pick one by name."""
    max_loras: int = 1
    """Distinct LoRA adapters that can run in one batch (the worker's adapter slots)."""
    max_lora_rank: int = 16
    """The largest LoRA rank served; an adapter of a higher rank is refused."""
    max_cpu_loras: int | None = None
    """LoRA adapters kept read in memory (least recently used leave first); at least
    --max-loras, which is the default."""
    lora_dtype: str = "auto"
    """Data type of the LoRA weights and their matmuls: auto (the model's), float16, bfloat16,
    float32."""


# --speculative-config keys as vLLM names them; the values tokenloom cannot honour are refused
# by SpeculativeConfig.from_dict (the rest of vLLM's keys are refused as unknown)
SPECULATIVE_CONFIG_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
    "model",
    "quantization",
    "max_model_len",
    "revision",
    "draft_tensor_parallel_size",
    "acceptance_method",
    "disable_logprobs",
    "disable_log_stats",
    "adaptive_num_speculative_tokens",
    "verify_row_cost",
)
# vLLM's default n-gram window when neither bound is given
DEFAULT_PROMPT_LOOKUP = 5


@dataclass
class SpeculativeConfig:
    """Speculative decoding, from ``--speculative-config`` (vLLM's JSON keys) or the older
    individual flags: a proposer plugin (``method``) drafts up to ``num_speculative_tokens``
    tokens per decoding sequence, and the target model verifies them all in one step."""

    method: str = "ngram"
    """The proposer plugin: ``ngram`` (prompt lookup), ``draft_model`` (a smaller model with the
    target's tokenizer, ``model``) or one a plugin registers."""
    num_speculative_tokens: int = 1
    """Draft tokens proposed per sequence and step (k): a step checks up to k + 1 tokens."""
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    """ngram: the shortest suffix of the sequence looked up in its earlier tokens."""
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    """ngram: the longest suffix looked up (the longest match is tried first)."""
    disable_by_batch_size: int | None = None
    """No speculation while more than this many requests are running or waiting: a full batch
    already keeps the machine busy, and drafts would only add work."""
    model: str | None = None
    """The draft model of a method that runs one (same tokenizer as the target): a path, a GGUF
    file or a packaged model name, resolved like the target's ``--model``."""
    quantization: str | None = None
    """The draft model's quantization method."""
    max_model_len: int | None = None
    """The draft model's context length."""
    disable_log_stats: bool = False
    """Leave the acceptance rate out of the periodic log line."""
    adaptive_num_speculative_tokens: bool = True
    """Draft fewer than ``num_speculative_tokens`` for a request whose drafts are seldom
    accepted: each request drafts the length its own acceptance so far makes pay best (see
    tokenloom/core/spec_decode/draft_length.py), at least one. False: always
    ``num_speculative_tokens``, as vLLM does."""
    verify_row_cost: float | None = None
    """With ``adaptive_num_speculative_tokens``: the time one more verified token adds to a
    decode step, as a fraction of that step (the platform's measured default when unset)."""

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> SpeculativeConfig:
        """vLLM's ``--speculative-config`` object -> a checked config; a ConfigError names the
        key to change."""

        def bad(message: str) -> ConfigError:
            return ConfigError(f"--speculative-config: {message}", param="speculative-config")

        for key in options:
            if key not in SPECULATIVE_CONFIG_KEYS:
                raise bad(f"unknown key {key!r}; known: {', '.join(SPECULATIVE_CONFIG_KEYS)}")
        values = dict(options)
        method = values.pop("method", None)
        if method is None:
            method = "draft_model" if values.get("model") else None
        if method is None:
            raise bad('give "method" (e.g. "ngram") or a draft "model"')
        if not isinstance(method, str) or not method:
            raise bad(f'"method" must be a proposer name, got {method!r}')
        if method == "ngram":
            # nothing would read a draft model's settings: refuse them rather than drop them
            for key in ("model", "quantization", "max_model_len"):
                if values.get(key) is not None:
                    raise bad(
                        f"{key} describes a draft model, and method 'ngram' runs none (it drafts from the prompt); remove {key}"
                    )
        if method == "draft_model":
            if not values.get("model"):
                raise bad(
                    'method "draft_model" needs "model": the draft model (a path, a GGUF file or a packaged name)'
                )
            if not isinstance(values["model"], str):
                raise bad(f'"model" must be a model name or path, got {values["model"]!r}')
            # the draft model proposes; a lookup setting would be read by nothing
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if values.get(key) is not None:
                    raise bad(
                        f"{key} configures n-gram lookup, and method 'draft_model' drafts with a model; remove {key}"
                    )
        if values.get("draft_tensor_parallel_size") not in (None, 1):
            raise bad("draft_tensor_parallel_size must be 1: tokenloom runs the draft in the target's worker")
        values.pop("draft_tensor_parallel_size", None)
        if values.get("acceptance_method", "rejection_sampler") != "rejection_sampler":
            raise bad(
                f"acceptance_method {values['acceptance_method']!r} is not implemented; "
                "tokenloom verifies drafts with rejection_sampler, which keeps the target distribution exactly"
            )
        values.pop("acceptance_method", None)
        # vLLM may skip logprobs while speculating; tokenloom always computes the ones a request
        # asks for with the target model, which satisfies either value: checked, then dropped
        if not isinstance(values.pop("disable_logprobs", False), bool):
            raise bad("disable_logprobs must be true or false")
        if values.pop("revision", None) is not None:
            raise bad("revision is not implemented; pin the draft model by a local path instead")
        if "num_speculative_tokens" not in values:
            raise bad('"num_speculative_tokens" is required (the number of draft tokens per step, e.g. 3)')
        lookup_min, lookup_max = values.pop("prompt_lookup_min", None), values.pop("prompt_lookup_max", None)
        # one bound given: the other equals it (vLLM's rule)
        if lookup_min is None and lookup_max is None:
            lookup_min = lookup_max = DEFAULT_PROMPT_LOOKUP
        elif lookup_min is None:
            lookup_min = lookup_max
        elif lookup_max is None:
            lookup_max = lookup_min
        config = cls(method=method, prompt_lookup_min=lookup_min, prompt_lookup_max=lookup_max, **values)
        config.validate()
        return config

    def validate(self) -> None:
        def bad(message: str) -> ConfigError:
            return ConfigError(f"--speculative-config: {message}", param="speculative-config")

        def is_int(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not is_int(self.num_speculative_tokens) or not 1 <= self.num_speculative_tokens <= 64:
            raise bad(f"num_speculative_tokens must be an integer in [1, 64], got {self.num_speculative_tokens!r}")
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, key)
            if not is_int(value) or value < 1:
                raise bad(f"{key} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise bad(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.disable_by_batch_size is not None and (
            not is_int(self.disable_by_batch_size) or self.disable_by_batch_size < 1
        ):
            raise bad(f"disable_by_batch_size must be a positive integer, got {self.disable_by_batch_size!r}")
        if self.max_model_len is not None and (not is_int(self.max_model_len) or self.max_model_len < 1):
            raise bad(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if not isinstance(self.adaptive_num_speculative_tokens, bool):
            raise bad(
                f"adaptive_num_speculative_tokens must be true or false, got {self.adaptive_num_speculative_tokens!r}"
            )
        if self.verify_row_cost is not None and (
            isinstance(self.verify_row_cost, bool)
            or not isinstance(self.verify_row_cost, (int, float))
            or not 0 <= self.verify_row_cost <= 10
        ):
            raise bad(
                "verify_row_cost must be a number in [0, 10] (one more verified token's time as a fraction "
                f"of a decode step, e.g. 0.06), got {self.verify_row_cost!r}"
            )


KV_EVENTS_PUBLISHERS = ("null", "zmq")


@dataclass
class KVEventsConfig:
    """KV-cache events, from ``--kv-events-config`` (vLLM's JSON keys and defaults): what the
    prefix cache stores, evicts and clears, published as vLLM's msgpack event batches."""

    enable_kv_cache_events: bool = False
    """Record BlockStored, BlockRemoved and AllBlocksCleared events as the prefix cache changes."""
    publisher: str | None = None
    """``zmq`` or ``null`` (record nothing, publish nothing); unset: ``zmq`` when events are
    enabled, else ``null``."""
    endpoint: str = "tcp://*:5557"
    """The ZMQ PUB address: bound when it holds ``*``, ``::``, or is ``ipc://`` or ``inproc://``,
    connected to otherwise. With ``-dp``, replica r publishes on the port plus r."""
    replay_endpoint: str | None = None
    """The ZMQ ROUTER address (always bound) that sends again the batches from a given sequence
    number on; unset: no replay."""
    buffer_steps: int = 10_000
    """Batches (one per engine step that changed the cache) kept for replay."""
    hwm: int = 100_000
    """The PUB socket's high-water mark: messages queued for a slow subscriber before ZMQ drops."""
    max_queue_size: int = 100_000
    """Batches waiting for the publisher thread; past that, a step's batch is dropped (the step
    never waits) and a warning is logged."""
    topic: str = ""
    """The topic frame of every published message (subscribers filter on its prefix)."""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> KVEventsConfig:
        """vLLM's ``--kv-events-config`` object -> a checked config; a ConfigError names the key."""
        known = [f.name for f in dataclasses.fields(cls)]
        for key in options:
            if key not in known:
                raise _bad_kv_events(f"unknown key {key!r}; known: {', '.join(known)}")
        config = cls(**options)
        config.validate()
        return config

    @property
    def publishes(self) -> bool:
        """Events are recorded and published (a ``zmq`` publisher with events enabled)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def validate(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise _bad_kv_events(f"enable_kv_cache_events must be true or false, got {self.enable_kv_cache_events!r}")
        if self.publisher not in KV_EVENTS_PUBLISHERS:
            raise _bad_kv_events(
                f"publisher {self.publisher!r} is not implemented; use one of {', '.join(KV_EVENTS_PUBLISHERS)}"
            )
        for key in ("endpoint", "topic"):
            if not isinstance(getattr(self, key), str):
                raise _bad_kv_events(f"{key} must be a string, got {getattr(self, key)!r}")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise _bad_kv_events(f"replay_endpoint must be a string, got {self.replay_endpoint!r}")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise _bad_kv_events(f"{key} must be a whole number of at least 1, got {value!r}")
        if self.publishes and importlib.util.find_spec("zmq") is None:
            raise _bad_kv_events("the zmq publisher needs pyzmq and msgspec: pip install 'tokenloom[kv-events]'")


def _bad_kv_events(message: str) -> ConfigError:
    return ConfigError(f"--kv-events-config: {message}", param="kv-events-config")


@dataclass
class EngineConfig:
    """The grouped configuration the engine and its executor receive, as the user gave it:
    the engine never writes into it (what it resolves travels in a
    :class:`~tokenloom.core.executor.WorkerSpec`)."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig
    load: LoadConfig
    structured_output: StructuredOutputConfig
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    speculative: SpeculativeConfig | None = None
    """Set when speculative decoding is on."""
    kv_events: KVEventsConfig = dataclasses.field(default_factory=KVEventsConfig)
    kv_transfer: KVTransferConfig | None = None
    """Set when a KV connector runs (``--kv-transfer-config``)."""


_GROUPS: tuple[tuple[str, type], ...] = (
    ("model", ModelConfig),
    ("cache", CacheConfig),
    ("scheduler", SchedulerConfig),
    ("parallel", ParallelConfig),
    ("device", DeviceConfig),
    ("load", LoadConfig),
    ("lora", LoRAConfig),
)


def _engine_arg_fields() -> dict[str, str]:
    """field name -> group, for every field of every group above."""
    names: dict[str, str] = {}
    for group, cls in _GROUPS:
        for f in dataclasses.fields(cls):
            names[f.name] = group
    return names


ENGINE_ARG_GROUPS = _engine_arg_fields()
# engine args that hold a whole config as vLLM's JSON, turned into their group by EngineArgs
JSON_CONFIG_ARGS = ("speculative_config", "kv_events_config", "kv_transfer_config")
# structured-output fields take vLLM's engine-arg names
STRUCTURED_OUTPUT_ARGS = {
    "guided_decoding_backend": "backend",
    "guided_decoding_disable_fallback": "disable_fallback",
    "guided_decoding_disable_any_whitespace": "disable_any_whitespace",
    "guided_decoding_disable_additional_properties": "disable_additional_properties",
    "reasoning_parser": "reasoning_parser",
    "structured_outputs_compile_timeout": "compile_timeout",
    "structured_outputs_request_backends": "request_backends",
}


@dataclass
class EngineArgs:
    """Engine arguments by their vLLM names, e.g. ``EngineArgs(model="smollm2",
    max_model_len=2048, num_gpu_blocks_override=64)``: one field per field of the config
    groups above (their defaults and docstrings are the groups'), checked and grouped into an
    :class:`EngineConfig` by :meth:`create_engine_config`.
    """

    # -> ModelConfig
    model: str = ModelConfig.model
    tokenizer: str | None = ModelConfig.tokenizer
    tokenizer_mode: str = ModelConfig.tokenizer_mode
    revision: str | None = ModelConfig.revision
    tokenizer_revision: str | None = ModelConfig.tokenizer_revision
    dtype: str = ModelConfig.dtype
    max_model_len: int | None = ModelConfig.max_model_len
    served_model_name: str | list[str] | None = ModelConfig.served_model_name
    seed: int | None = ModelConfig.seed
    hf_overrides: dict[str, Any] | None = ModelConfig.hf_overrides
    rope_scaling: dict[str, Any] | None = ModelConfig.rope_scaling
    rope_theta: float | None = ModelConfig.rope_theta
    trust_remote_code: bool = ModelConfig.trust_remote_code
    max_logprobs: int = ModelConfig.max_logprobs
    logprobs_mode: str = ModelConfig.logprobs_mode
    skip_tokenizer_init: bool = ModelConfig.skip_tokenizer_init
    generation_config: str = ModelConfig.generation_config
    override_generation_config: dict[str, Any] | None = ModelConfig.override_generation_config
    enforce_eager: bool = ModelConfig.enforce_eager
    task: str = ModelConfig.task
    runner: str = ModelConfig.runner
    convert: str = ModelConfig.convert
    override_pooler_config: dict[str, Any] | None = ModelConfig.override_pooler_config
    disable_sliding_window: bool = ModelConfig.disable_sliding_window
    model_impl: str = ModelConfig.model_impl
    quantization: str | None = ModelConfig.quantization
    logits_processors: list[str] | None = ModelConfig.logits_processors
    logits_processor_pattern: str | None = ModelConfig.logits_processor_pattern
    # -> CacheConfig
    block_size: int = CacheConfig.block_size
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    kv_cache_memory_bytes: int | None = CacheConfig.kv_cache_memory_bytes
    num_gpu_blocks_override: int | None = CacheConfig.num_gpu_blocks_override
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    prefix_caching_hash_algo: str = CacheConfig.prefix_caching_hash_algo
    cache_dtype: str = CacheConfig.cache_dtype
    calculate_kv_scales: bool = CacheConfig.calculate_kv_scales
    # -> SchedulerConfig
    max_num_batched_tokens: int | None = SchedulerConfig.max_num_batched_tokens
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill
    max_num_partial_prefills: int = SchedulerConfig.max_num_partial_prefills
    long_prefill_token_threshold: int = SchedulerConfig.long_prefill_token_threshold
    scheduling_policy: str = SchedulerConfig.scheduling_policy
    max_waiting_requests: int | None = SchedulerConfig.max_waiting_requests
    # -> ParallelConfig
    tensor_parallel_size: int = ParallelConfig.tensor_parallel_size
    pipeline_parallel_size: int = ParallelConfig.pipeline_parallel_size
    data_parallel_size: int = ParallelConfig.data_parallel_size
    data_parallel_size_local: int | None = ParallelConfig.data_parallel_size_local
    data_parallel_backend: str = ParallelConfig.data_parallel_backend
    data_parallel_rank: int = ParallelConfig.data_parallel_rank
    distributed_executor_backend: str | None = ParallelConfig.distributed_executor_backend
    # -> DeviceConfig
    device: str = DeviceConfig.device
    attention_backend: str = DeviceConfig.attention_backend
    # -> LoadConfig
    load_format: str = LoadConfig.load_format
    download_dir: str | None = LoadConfig.download_dir
    ignore_patterns: list[str] | None = LoadConfig.ignore_patterns
    use_tqdm_on_load: bool = LoadConfig.use_tqdm_on_load
    model_loader_extra_config: dict[str, Any] | None = LoadConfig.model_loader_extra_config
    # -> LoRAConfig
    enable_lora: bool = LoRAConfig.enable_lora
    max_loras: int = LoRAConfig.max_loras
    max_lora_rank: int = LoRAConfig.max_lora_rank
    max_cpu_loras: int | None = LoRAConfig.max_cpu_loras
    lora_dtype: str = LoRAConfig.lora_dtype
    # -> StructuredOutputConfig, by vLLM's engine-argument names
    guided_decoding_backend: str = StructuredOutputConfig.backend
    guided_decoding_disable_fallback: bool = StructuredOutputConfig.disable_fallback
    guided_decoding_disable_any_whitespace: bool = StructuredOutputConfig.disable_any_whitespace
    guided_decoding_disable_additional_properties: bool = StructuredOutputConfig.disable_additional_properties
    reasoning_parser: str | None = StructuredOutputConfig.reasoning_parser
    structured_outputs_compile_timeout: float = StructuredOutputConfig.compile_timeout
    structured_outputs_request_backends: str = StructuredOutputConfig.request_backends
    # -> SpeculativeConfig (vLLM's JSON object; None: no speculative decoding)
    speculative_config: dict[str, Any] | None = None
    # -> KVEventsConfig (vLLM's JSON object; None: no KV-cache events)
    kv_events_config: dict[str, Any] | None = None
    # -> KVTransferConfig (vLLM's JSON object; None: no KV connector)
    kv_transfer_config: dict[str, Any] | None = None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """``EngineArgs(**kwargs)``, with an unknown name a ConfigError that suggests the
        closest known one (``LLM(**engine_args)`` passes user input through here)."""
        known = [f.name for f in dataclasses.fields(cls)]
        for name in kwargs:
            if name not in known:
                from tokenloom.errors import closest_match

                hint = closest_match(name, sorted(known))
                raise ConfigError(
                    f"unknown engine argument {name!r}" + (f"; did you mean {hint!r}?" if hint else ""),
                    param=name,
                )
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        groups: dict[str, dict[str, Any]] = {group: {} for group, _ in _GROUPS}
        structured: dict[str, Any] = {}
        for name, value in ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)):
            if name in JSON_CONFIG_ARGS:
                continue
            if name in STRUCTURED_OUTPUT_ARGS:
                structured[STRUCTURED_OUTPUT_ARGS[name]] = value
            else:
                groups[ENGINE_ARG_GROUPS[name]][name] = value
        if isinstance(groups["model"]["served_model_name"], str):
            groups["model"]["served_model_name"] = [groups["model"]["served_model_name"]]
        config = EngineConfig(
            model=ModelConfig(**groups["model"]),
            cache=CacheConfig(**groups["cache"]),
            scheduler=SchedulerConfig(**groups["scheduler"]),
            parallel=ParallelConfig(**groups["parallel"]),
            device=DeviceConfig(**groups["device"]),
            load=LoadConfig(**groups["load"]),
            structured_output=StructuredOutputConfig(**structured),
            lora=LoRAConfig(**groups["lora"]),
            speculative=self._speculative(),
            kv_events=self._kv_events(),
            kv_transfer=None
            if self.kv_transfer_config is None
            else KVTransferConfig.from_dict(self.kv_transfer_config),
        )
        validate_engine_config(config)
        return config

    def _speculative(self) -> SpeculativeConfig | None:
        options = self.speculative_config
        if options is None:
            return None
        if isinstance(options, SpeculativeConfig):
            options.validate()
            return options
        if not isinstance(options, dict):
            raise ConfigError(
                f"--speculative-config must be a JSON object, got {type(options).__name__}", param="speculative-config"
            )
        return SpeculativeConfig.from_dict(options) if options else None

    def _kv_events(self) -> KVEventsConfig:
        options = self.kv_events_config
        if isinstance(options, KVEventsConfig):
            options.validate()
            return options
        if options is not None and not isinstance(options, dict):
            raise _bad_kv_events(f"must be a JSON object, got {type(options).__name__}")
        return KVEventsConfig.from_dict(options or {})


def check_worker_grid(parallel: ParallelConfig) -> None:
    """``-tp``/``-pp`` are positive, and the executor named can hold ``tp * pp`` workers."""
    for flag, size in (
        ("tensor-parallel-size", parallel.tensor_parallel_size),
        ("pipeline-parallel-size", parallel.pipeline_parallel_size),
    ):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"--{flag}: must be a whole number of at least 1, got {size!r}", param=flag)
    if parallel.distributed_executor_backend == "uni" and parallel.world_size > 1:
        raise ConfigError(
            f"--distributed-executor-backend uni runs one worker in the engine's process, but "
            f"-tp {parallel.tensor_parallel_size} -pp {parallel.pipeline_parallel_size} needs "
            f"{parallel.world_size} workers: use mp (worker processes on this machine, the default) or ray",
            param="distributed-executor-backend",
        )


DATA_PARALLEL_BACKENDS = ("mp", "ray")


def validate_data_parallel(parallel: ParallelConfig) -> None:
    """``-dp``, ``--data-parallel-size-local`` and ``--data-parallel-backend`` make sense together."""

    def bad(flag: str, message: str) -> None:
        raise ConfigError(f"--{flag}: {message}", param=flag)

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    size = parallel.data_parallel_size
    if not is_int(size) or size < 1:
        bad("data-parallel-size", f"must be a whole number of at least 1, got {size!r}")
    if parallel.data_parallel_backend not in DATA_PARALLEL_BACKENDS:
        bad(
            "data-parallel-backend",
            f"must be one of {', '.join(DATA_PARALLEL_BACKENDS)}, got {parallel.data_parallel_backend!r}",
        )
    local = parallel.data_parallel_size_local
    if local is None:
        return
    if not is_int(local) or not 0 <= local <= size:
        bad("data-parallel-size-local", f"must be between 0 and --data-parallel-size ({size}), got {local!r}")
    if local != size and parallel.data_parallel_backend != "ray":
        # replicas on other machines need something that starts them there: Ray does
        bad(
            "data-parallel-size-local",
            f"{local} of {size} replicas on this node needs --data-parallel-backend ray (the mp backend "
            "starts every replica on this machine); leave it unset or equal to --data-parallel-size",
        )


def validate_engine_config(config: EngineConfig) -> None:
    """Checks that need no model files: value ranges and choices."""

    def bad(flag: str, message: str) -> None:
        raise ConfigError(f"--{flag}: {message}", param=flag)

    if config.cache.block_size < 1 or config.cache.block_size & (config.cache.block_size - 1):
        bad("block-size", f"must be a positive power of two, got {config.cache.block_size}")
    if not 0.0 < config.cache.gpu_memory_utilization <= 1.0:
        bad("gpu-memory-utilization", f"must be in (0, 1], got {config.cache.gpu_memory_utilization}")
    if config.cache.cache_dtype == "fp8_inc":
        bad(
            "kv-cache-dtype",
            "fp8_inc (Intel Neural Compressor's FP8 cache for Gaudi) is not built in tokenloom: "
            "use fp8, fp8_e4m3 or fp8_e5m2",
        )
    if config.cache.num_gpu_blocks_override is not None and config.cache.num_gpu_blocks_override < 1:
        bad("num-gpu-blocks-override", f"must be at least 1, got {config.cache.num_gpu_blocks_override}")
    if config.scheduler.max_num_seqs < 1:
        bad("max-num-seqs", f"must be at least 1, got {config.scheduler.max_num_seqs}")
    budget = config.scheduler.max_num_batched_tokens
    if budget is not None and budget < 1:
        bad("max-num-batched-tokens", f"must be at least 1, got {budget}")
    if config.scheduler.scheduling_policy not in ("fcfs", "priority"):
        bad("scheduling-policy", f"must be fcfs or priority, got {config.scheduler.scheduling_policy!r}")
    if config.model.dtype not in DTYPE_CHOICES:
        bad("dtype", f"must be one of {', '.join(DTYPE_CHOICES)}, got {config.model.dtype!r}")
    if config.model.max_model_len is not None and config.model.max_model_len < 1:
        bad("max-model-len", f"must be at least 1, got {config.model.max_model_len}")
    timeout = config.structured_output.compile_timeout
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        bad("structured-outputs-compile-timeout", f"must be a positive number of seconds, got {timeout!r}")
    if config.model.logits_processor_pattern is not None:
        import re

        try:
            re.compile(config.model.logits_processor_pattern)
        except re.error as exc:
            bad("logits-processor-pattern", f"is not a valid regular expression: {exc}")
    if config.model.max_logprobs < -1:
        bad("max-logprobs", f"must be -1 (no cap) or at least 0, got {config.model.max_logprobs}")
    lora = config.lora
    if lora.max_loras < 1:
        bad("max-loras", f"must be at least 1, got {lora.max_loras}")
    if lora.max_lora_rank < 1:
        bad("max-lora-rank", f"must be at least 1, got {lora.max_lora_rank}")
    if lora.max_cpu_loras is not None and lora.max_cpu_loras < lora.max_loras:
        bad("max-cpu-loras", f"must be at least --max-loras ({lora.max_loras}), got {lora.max_cpu_loras}")
    if lora.lora_dtype not in LORA_DTYPE_CHOICES:
        bad("lora-dtype", f"must be one of {', '.join(LORA_DTYPE_CHOICES)}, got {lora.lora_dtype!r}")
    check_worker_grid(config.parallel)
    validate_data_parallel(config.parallel)
    if config.speculative is not None and config.parallel.pipeline_parallel_size > 1:
        # refused here, before any worker starts: a stage before the last never sees the
        # drafts its successor verifies, and the draft model would run on one stage only
        bad(
            "speculative-config",
            f"speculative decoding does not run with pipeline parallelism yet (--pipeline-parallel-size "
            f"{config.parallel.pipeline_parallel_size}): drop --speculative-config or use --pipeline-parallel-size 1",
        )
    if config.model.tokenizer_mode not in ("auto", "slow"):
        bad(
            "tokenizer-mode",
            f"{config.model.tokenizer_mode!r} is not implemented: tokenloom reads Hugging Face tokenizers "
            "(tokenizer.json) and GGUF vocabularies; use auto or slow",
        )
    if config.model.model_impl not in MODEL_IMPL_CHOICES:
        bad(
            "model-impl",
            f"{config.model.model_impl!r} is not implemented: tokenloom runs its native model plugins or "
            "transformers' modeling code; use auto, vllm (native) or transformers",
        )
    if config.model.tokenizer_revision is not None:
        bad("tokenizer-revision", "is not implemented: pass a local tokenizer directory to --tokenizer")
    from tokenloom.core.generation_config import check_generation_config_choice, check_override

    check_generation_config_choice(config.model.generation_config)
    check_override(config.model.override_generation_config)
    if config.load.model_loader_extra_config:
        bad("model-loader-extra-config", "is not implemented: no tokenloom load format takes extra options")
