"""Typed engine configuration: one dataclass per concern, and :class:`EngineArgs`, the flat
set of engine arguments by their vLLM names (``LLM(**kwargs)`` and the CLI map onto it).

Attribute docstrings (the string literal under each field) are the CLI help texts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tokenloom.errors import ConfigError

DTYPE_CHOICES = ("auto", "half", "float16", "bfloat16", "float", "float32")


@dataclass
class ModelConfig:
    model: str = "smollm2"
    """Name or path of the model: a local directory, a .gguf file, a Hugging Face repo id, or
    the short name of a model shipped in a pip package (``smollm2``, ``gemma3-270m``,
    ``all-minilm-l6-v2``)."""
    tokenizer: str | None = None
    """Name or path of the tokenizer; defaults to the model's."""
    tokenizer_mode: str = "auto"
    """``auto`` uses the fast tokenizer when there is one, ``slow`` forces the slow one."""
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
    """Random seed for weight initialisation (dummy weights) and unseeded sampling."""
    hf_overrides: dict[str, Any] | None = None
    """JSON dict of values to override in the model's Hugging Face config."""
    rope_scaling: dict[str, Any] | None = None
    """JSON dict of RoPE scaling settings, e.g. ``{"rope_type": "linear", "factor": 2.0}``."""
    rope_theta: float | None = None
    """RoPE theta; overrides the model's."""
    trust_remote_code: bool = False
    """Accepted for compatibility; tokenloom never runs model code from the model's files."""
    max_logprobs: int = 20
    """Maximum number of log probabilities to return per token (logprobs, prompt_logprobs)."""
    logprobs_mode: str = "raw_logprobs"
    """What logprobs hold: raw_logprobs, processed_logprobs, raw_logits, processed_logits."""
    skip_tokenizer_init: bool = False
    """Skip tokenizer initialisation; prompts must then be token ids."""
    generation_config: str = "auto"
    """``auto`` reads generation defaults from the model; ``vllm`` ignores them."""
    enforce_eager: bool = False
    """Always run the model eagerly (no torch.compile)."""
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
    quantization: str | None = None
    """Quantization method of the weights; default is what the model's files need."""


@dataclass
class CacheConfig:
    block_size: int = 16
    """Tokens per KV-cache block."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the device's memory the engine may use (on the CPU, of available RAM,
    capped by ``--kv-cache-memory-bytes`` when given)."""
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
    """Number of tensor-parallel ranks."""
    pipeline_parallel_size: int = 1
    """Number of pipeline stages."""
    data_parallel_size: int = 1
    """Number of data-parallel replicas."""
    distributed_executor_backend: str | None = None
    """Executor plugin that owns the workers (``uni`` by default)."""


@dataclass
class DeviceConfig:
    device: str = "auto"
    """Device platform plugin; ``auto`` picks the first available."""


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


_GROUPS: tuple[tuple[str, type], ...] = (
    ("model", ModelConfig),
    ("cache", CacheConfig),
    ("scheduler", SchedulerConfig),
    ("parallel", ParallelConfig),
    ("device", DeviceConfig),
    ("load", LoadConfig),
)


def _engine_arg_fields() -> dict[str, str]:
    """field name -> group, for every field of every group above."""
    names: dict[str, str] = {}
    for group, cls in _GROUPS:
        for f in dataclasses.fields(cls):
            names[f.name] = group
    return names


ENGINE_ARG_GROUPS = _engine_arg_fields()
# structured-output fields take vLLM's engine-arg names
STRUCTURED_OUTPUT_ARGS = {
    "guided_decoding_backend": "backend",
    "guided_decoding_disable_fallback": "disable_fallback",
    "guided_decoding_disable_any_whitespace": "disable_any_whitespace",
    "guided_decoding_disable_additional_properties": "disable_additional_properties",
    "reasoning_parser": "reasoning_parser",
    "structured_outputs_compile_timeout": "compile_timeout",
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
    enforce_eager: bool = ModelConfig.enforce_eager
    task: str = ModelConfig.task
    runner: str = ModelConfig.runner
    convert: str = ModelConfig.convert
    override_pooler_config: dict[str, Any] | None = ModelConfig.override_pooler_config
    disable_sliding_window: bool = ModelConfig.disable_sliding_window
    quantization: str | None = ModelConfig.quantization
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
    distributed_executor_backend: str | None = ParallelConfig.distributed_executor_backend
    # -> DeviceConfig
    device: str = DeviceConfig.device
    # -> LoadConfig
    load_format: str = LoadConfig.load_format
    download_dir: str | None = LoadConfig.download_dir
    ignore_patterns: list[str] | None = LoadConfig.ignore_patterns
    use_tqdm_on_load: bool = LoadConfig.use_tqdm_on_load
    model_loader_extra_config: dict[str, Any] | None = LoadConfig.model_loader_extra_config
    # -> StructuredOutputConfig, by vLLM's engine-argument names
    guided_decoding_backend: str = StructuredOutputConfig.backend
    guided_decoding_disable_fallback: bool = StructuredOutputConfig.disable_fallback
    guided_decoding_disable_any_whitespace: bool = StructuredOutputConfig.disable_any_whitespace
    guided_decoding_disable_additional_properties: bool = StructuredOutputConfig.disable_additional_properties
    reasoning_parser: str | None = StructuredOutputConfig.reasoning_parser
    structured_outputs_compile_timeout: float = StructuredOutputConfig.compile_timeout

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
        )
        validate_engine_config(config)
        return config


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
    if config.model.max_logprobs < 0:
        bad("max-logprobs", f"must be non-negative, got {config.model.max_logprobs}")
    for flag, size in (
        ("tensor-parallel-size", config.parallel.tensor_parallel_size),
        ("pipeline-parallel-size", config.parallel.pipeline_parallel_size),
        ("data-parallel-size", config.parallel.data_parallel_size),
    ):
        if size < 1:
            bad(flag, f"must be at least 1, got {size}")
