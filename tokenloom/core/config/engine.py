"""``EngineConfig``, the sections together as the engine receives them, and ``EngineArgs``, the
flat engine arguments by their vLLM names (``LLM(**kwargs)`` and the CLI map onto it), grouped
and checked into an ``EngineConfig``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tokenloom.core.config.cache import CacheConfig
from tokenloom.core.config.device import DeviceConfig
from tokenloom.core.config.kv_events import KVEventsConfig
from tokenloom.core.config.kv_transfer import KVTransferConfig
from tokenloom.core.config.load import LoadConfig
from tokenloom.core.config.lora import LORA_DTYPE_CHOICES, LoRAConfig
from tokenloom.core.config.model import DTYPE_CHOICES, MODEL_IMPL_CHOICES, ModelConfig
from tokenloom.core.config.parallel import ParallelConfig, check_worker_grid, validate_data_parallel, validate_nodes
from tokenloom.core.config.scheduler import SchedulerConfig
from tokenloom.core.config.speculative import SpeculativeConfig
from tokenloom.core.config.structured_output import StructuredOutputConfig
from tokenloom.errors import ConfigError


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


# the sections EngineArgs' fields are grouped into by name (structured output, speculative
# decoding and KV events take their own names or JSON)
CONFIG_GROUPS: tuple[tuple[str, type], ...] = (
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
    for group, cls in CONFIG_GROUPS:
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
    mmproj: str | None = ModelConfig.mmproj
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
    data_parallel_external_lb: bool = ParallelConfig.data_parallel_external_lb
    data_parallel_hybrid_lb: bool = ParallelConfig.data_parallel_hybrid_lb
    data_parallel_start_rank: int = ParallelConfig.data_parallel_start_rank
    data_parallel_address: str | None = ParallelConfig.data_parallel_address
    data_parallel_rpc_port: int = ParallelConfig.data_parallel_rpc_port
    nnodes: int = ParallelConfig.nnodes
    node_rank: int = ParallelConfig.node_rank
    master_addr: str = ParallelConfig.master_addr
    master_port: int = ParallelConfig.master_port
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
        groups: dict[str, dict[str, Any]] = {group: {} for group, _ in CONFIG_GROUPS}
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
            raise ConfigError(
                f"--kv-events-config must be a JSON object, got {type(options).__name__}", param="kv-events-config"
            )
        return KVEventsConfig.from_dict(options or {})


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
    validate_nodes(config.parallel)
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
