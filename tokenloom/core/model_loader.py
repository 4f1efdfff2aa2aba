"""From a model tag to a built model, by asking the registries: which model source resolves
the tag, which load format reads the files, which model class implements the architecture,
which quantization plugin the weights need (the checkpoint's, detected; ``--quantization``
that disagrees is refused).

:func:`resolve_model` runs in the main process (cheap: config and tokenizer only) and gives
:class:`ModelInfo`, plain data a worker can receive; :func:`build_model` runs in the worker.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenloom.core.config import EngineConfig, ModelConfig
from tokenloom.core.generation_config import resolve_generation_defaults
from tokenloom.core.model_interface import mixture_of_experts_error
from tokenloom.core.pooling import (
    GENERATE,
    POOLING,
    resolve_pooler_config,
    resolve_runner,
    sentence_transformers_max_seq_length,
)
from tokenloom.errors import ConfigError, ModelLoadError, UnknownNameError
from tokenloom.plugins.manager import PluginSet

if TYPE_CHECKING:
    import torch

    from tokenloom.core.model_files import LoadFormat, ModelSource, ResolvedModel
    from tokenloom.plugins.registry import Registry

logger = logging.getLogger(__name__)

ADD_MODEL_HINT = (
    "to add an architecture, write a model plugin: "
    "@hookimpl def register_models(register): register('MyArch', 'my_pkg.model:MyModel') "
    "(see PLUGINS.md, register_models)"
)


# the ``model`` registry name of the Transformers fallback (vLLM's name for its own): a model
# plugin that runs transformers' modeling code for any architecture transformers has. Its class
# has ``check_engine_config(hf_config, config) -> str``, the transformers class it would run, or
# a ModelLoadError / ConfigError saying why it cannot
TRANSFORMERS_FALLBACK = "TransformersForCausalLM"


@dataclass
class ModelInfo:
    """A resolved model, as plain data (what the worker needs to build it again)."""

    path: str
    name: str
    source: str
    load_format: str
    architecture: str
    quantization: str | None
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    # the config object itself (picklable); workers may also re-read it from the files
    hf_config: Any = None
    # "generate" or "pooling" (tokenloom.core.pooling.resolve_runner), and for pooling the
    # resolved PoolerConfig
    runner: str = "generate"
    pooler_config: Any = None
    # the request defaults in force (--generation-config), under SamplingParams' names
    generation_defaults: dict[str, Any] = field(default_factory=dict)


def resolve_source(
    model: str,
    plugins: PluginSet,
    model_config: ModelConfig,
    download_dir: str | None,
    skip_sources: tuple[str, ...] = (),
) -> ResolvedModel:
    """The first model source (in registration order) that recognises ``model``, resolved;
    sources named in ``skip_sources`` are not asked."""
    registry = plugins.registry("model_source")
    for entry in registry.entries():
        if entry.name in skip_sources:
            continue
        source: ModelSource = entry.resolve()()
        if source.matches(model):
            return source.resolve(model, revision=model_config.revision, download_dir=download_dir)
    raise ModelLoadError(
        f"no model source recognises {model!r}: pass a local directory or .gguf file, a Hugging Face "
        f"repo id (org/name), or a packaged model name; registered sources: {', '.join(registry.names()) or 'none'}"
    )


def choose_load_format(name: str, path: str, hint: str | None, plugins: PluginSet) -> tuple[str, LoadFormat]:
    """The load format plugin instance and its name (``auto`` asks each in order)."""
    registry = plugins.registry("load_format")
    if name != "auto":
        return name, registry.get(name)()
    candidates = ([hint] if hint and hint in registry else []) + [n for n in registry.names() if n != hint]
    for candidate in candidates:
        load_format = registry.get(candidate)()
        if getattr(load_format, "auto_selectable", True) and load_format.can_load(path):
            return candidate, load_format
    raise ModelLoadError(
        f"no load format can read the model files at {path}; registered formats: "
        f"{', '.join(registry.names()) or 'none'} (choose one with --load-format)"
    )


def resolve_model(config: EngineConfig, plugins: PluginSet) -> tuple[ModelInfo, Any]:
    """Resolve ``config.model`` to files, config and tokenizer. Returns (info, tokenizer)."""
    model_config = config.model
    started = time.perf_counter()
    resolved = resolve_source(model_config.model, plugins, model_config, config.load.download_dir)
    format_name, load_format = choose_load_format(config.load.load_format, resolved.path, resolved.load_format, plugins)
    if model_config.mmproj and format_name != "gguf":
        raise ConfigError(
            f"--mmproj goes with a GGUF model (llama.cpp's projector file beside its language model), not a "
            f"{format_name} one: drop --mmproj for {model_config.model}",
            param="mmproj",
        )
    config_started = time.perf_counter()
    hf_config = load_format.load_config(resolved.path, model_config)
    apply_rope_overrides(hf_config, model_config)
    tokenizer_started = time.perf_counter()
    tokenizer = None if model_config.skip_tokenizer_init else load_format.load_tokenizer(resolved.path, model_config)
    finished = time.perf_counter()
    logger.info(
        "resolved %s -> %s (%s, %s) in %.2fs: files %.2fs, config %.2fs, tokenizer %.2fs",
        model_config.model,
        resolved.path,
        resolved.source,
        format_name,
        finished - started,
        config_started - started,
        tokenizer_started - config_started,
        finished - tokenizer_started,
    )

    model_registry = plugins.registry("model")
    architecture = choose_model_implementation(hf_config, config, model_registry)

    quantization = choose_quantization(model_config.quantization, load_format, resolved.path, hf_config, plugins)

    max_model_len = derive_max_model_len(hf_config, model_config)
    registered_runner = model_registry.entry(architecture).options.get("runner", GENERATE)
    runner = resolve_runner(model_config, architecture, registered_runner)
    pooler_config = None
    if runner == POOLING:
        pooler_config = resolve_pooler_config(resolved.path, model_config)
        trained_length = sentence_transformers_max_seq_length(resolved.path)
        if model_config.max_model_len is None and trained_length is not None:
            max_model_len = min(max_model_len, trained_length)  # sentence-transformers truncates there too
    info = ModelInfo(
        path=resolved.path,
        name=resolved.name,
        source=resolved.source,
        load_format=format_name,
        architecture=architecture,
        quantization=quantization,
        max_model_len=max_model_len,
        vocab_size=int(getattr(hf_config, "vocab_size", 0) or (len(tokenizer) if tokenizer is not None else 0)),
        eos_token_ids=eos_token_ids(hf_config, tokenizer),
        hf_config=hf_config,
        runner=runner,
        pooler_config=pooler_config,
        generation_defaults=resolve_generation_defaults(
            model_config.generation_config,
            model_config.override_generation_config,
            lambda: getattr(load_format, "generation_defaults", lambda path: {})(resolved.path),
        ),
    )
    return info, tokenizer


def choose_model_implementation(hf_config: Any, config: EngineConfig, model_registry: Registry) -> str:
    """The ``model`` registry name that builds the model, by ``--model-impl``: ``auto`` takes the
    native plugin of one of the config's ``architectures`` and else the Transformers fallback,
    ``vllm`` (or ``native``) only the native plugin, ``transformers`` only the fallback. The
    fallback's class says whether it can run the model (``check_engine_config``); the choice is
    logged."""
    model_impl = config.model.model_impl
    architectures: list[str] = list(getattr(hf_config, "architectures", None) or [])
    named = architectures[0] if architectures else "<none in config>"
    native = next((a for a in architectures if a in model_registry and a != TRANSFORMERS_FALLBACK), None)
    if native is not None and model_impl != "transformers":
        logger.info("model implementation (--model-impl %s): tokenloom's native %s", model_impl, native)
        return native
    if native is None:
        # a plugin registering the architecture serves its experts; without one, say what the model is
        moe_error = mixture_of_experts_error(hf_config, architectures[0] if architectures else "the model")
        if moe_error is not None:
            raise moe_error
    if model_impl in ("vllm", "native") or TRANSFORMERS_FALLBACK not in model_registry:
        raise UnknownNameError(
            "model architecture",
            named,
            [name for name in model_registry.names() if name != TRANSFORMERS_FALLBACK],
            hint=(
                "pass --model-impl transformers to run transformers' modeling code for it, or "
                if TRANSFORMERS_FALLBACK in model_registry
                else ""
            )
            + ADD_MODEL_HINT,
        )
    fallback = model_registry.get(TRANSFORMERS_FALLBACK)
    try:
        running: str = fallback.check_engine_config(hf_config, config)
    except ModelLoadError as exc:
        if model_impl == "auto":
            raise ModelLoadError(f"no native model plugin serves {named}, and {exc}") from exc
        raise
    logger.info(
        "model implementation (--model-impl %s): the Transformers fallback, running transformers' %s%s",
        model_impl,
        running,
        "" if native is None else f" instead of tokenloom's native {native}",
    )
    return TRANSFORMERS_FALLBACK


def checkpoint_quantization(load_format: LoadFormat, path: str, hf_config: Any) -> str | None:
    """The quantization the checkpoint states: its load format's (a GGUF file's tensor types),
    else config.json's ``quantization_config.quant_method``; None for a format that makes its
    own weights (``--load-format dummy``)."""
    stated = load_format.quantization(path)
    if stated is not None or getattr(load_format, "initializes_randomly", False):
        return stated
    config = getattr(hf_config, "quantization_config", None)
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    return str(method) if method is not None else None


def choose_quantization(
    requested: str | None, load_format: LoadFormat, path: str, hf_config: Any, plugins: PluginSet
) -> str | None:
    """The quantization method's registered name: the checkpoint's (``--quantization`` that
    names another is refused), else ``--quantization``'s, else None. The method's config is
    built once here, so a checkpoint it cannot serve fails before any worker starts."""
    stated = checkpoint_quantization(load_format, path, hf_config)
    if requested is not None and stated is not None and requested != stated:
        raise ConfigError(
            f"--quantization {requested} does not match the checkpoint at {path}, which is quantized with "
            f"{stated!r}: drop --quantization (it is detected) or pass --quantization {stated}",
            param="quantization",
        )
    name = stated or requested
    if name is not None:
        build_quantization_config(name, hf_config, plugins)
    return name


def build_quantization_config(name: str, hf_config: Any, plugins: PluginSet, exact_dtype: bool = True) -> Any:
    """The registered quantization plugin ``name``'s config for this checkpoint (an unknown
    name raises the registry's error listing the registered ones)."""
    config = plugins.registry("quantization").get(name).from_checkpoint(hf_config)
    config.exact_dtype = exact_dtype
    return config


def apply_rope_overrides(hf_config: Any, model_config: ModelConfig) -> None:
    """``--rope-scaling`` / ``--rope-theta`` (transformers 5 keeps both in rope_parameters)."""
    if model_config.rope_scaling is None and model_config.rope_theta is None:
        return
    parameters = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    if model_config.rope_scaling:
        parameters.update(model_config.rope_scaling)
        # vLLM's older spelling, {"type": ...}, replaces the model's own rope_type too
        if "type" in model_config.rope_scaling and "rope_type" not in model_config.rope_scaling:
            parameters["rope_type"] = model_config.rope_scaling["type"]
    if model_config.rope_theta is not None:
        parameters["rope_theta"] = model_config.rope_theta
        hf_config.rope_theta = model_config.rope_theta
    parameters.setdefault("rope_type", "default")
    if hasattr(hf_config, "rope_parameters"):
        hf_config.rope_parameters = parameters
    hf_config.rope_scaling = parameters


def derive_max_model_len(hf_config: Any, model_config: ModelConfig) -> int:
    text_config = getattr(hf_config, "text_config", None) or hf_config
    model_max = None
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length"):
        value = getattr(text_config, key, None)
        if isinstance(value, int) and value > 0:
            model_max = value
            break
    if model_config.max_model_len is None:
        if model_max is None:
            raise ConfigError("the model config states no context length: pass --max-model-len", param="max_model_len")
        return model_max
    if model_max is not None and model_config.max_model_len > model_max:
        raise ConfigError(
            f"--max-model-len {model_config.max_model_len} is larger than the model's context length {model_max}; "
            f"pass --max-model-len {model_max} or less (or leave it out)",
            param="max_model_len",
        )
    return model_config.max_model_len


def eos_token_ids(hf_config: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    config_eos = getattr(hf_config, "eos_token_id", None)
    for value in config_eos if isinstance(config_eos, (list, tuple)) else [config_eos]:
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if isinstance(tokenizer_eos, int) and tokenizer_eos not in ids:
        ids.append(tokenizer_eos)
    return ids


def resolve_dtype(name: str, hf_config: Any, platform: Any) -> torch.dtype:
    import torch

    explicit = {
        "half": torch.float16,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float": torch.float32,
        "float32": torch.float32,
    }
    if name in explicit:
        return explicit[name]
    # transformers 5 configs warn on reading the deprecated ``torch_dtype``: only older ones lack ``dtype``
    stored = (
        getattr(hf_config, "dtype", None) if hasattr(hf_config, "dtype") else getattr(hf_config, "torch_dtype", None)
    )
    if isinstance(stored, str):
        stored = getattr(torch, stored, torch.float32)
    chosen: torch.dtype = platform.default_dtype(stored if isinstance(stored, torch.dtype) else torch.float32)
    return chosen


def build_model(
    config: EngineConfig,
    info: ModelInfo,
    plugins: PluginSet,
    platform: Any,
    *,
    runner: str = "generate",
    parallel: Any = None,
) -> Any:
    """Construct the model plugin on the platform's device and load its weights (worker side);
    ``parallel`` (a ParallelState) tells a sharded model its rank and communicators."""
    import torch

    from tokenloom.core.model_interface import ModelContext

    started = time.perf_counter()
    device = platform.torch_device()
    dtype = resolve_dtype(config.model.dtype, info.hf_config, platform)
    exact_dtype = config.model.dtype != "auto"  # else the platform chose it
    model_class = plugins.registry("model").get(info.architecture)
    quantization = None
    if info.quantization is not None:
        quantization = build_quantization_config(info.quantization, info.hf_config, plugins, exact_dtype)
    context = ModelContext(
        hf_config=info.hf_config,
        dtype=dtype,
        device=device,
        quantization=quantization,
        exact_dtype=exact_dtype,
        model_config=config.model,
        runner=runner,
        pooler_config=info.pooler_config,
        parallel=parallel,
    )
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(context)
            if quantization is not None:
                quantization.bind_layers(model)  # each linear layer's method, by its module name
    finally:
        torch.set_default_dtype(previous_dtype)
    model.eval()
    built = time.perf_counter()

    load_format = plugins.registry("load_format").get(info.load_format)()
    reading = [0.0]  # seconds inside the load format's iterator: the rest of loading is the model's
    if getattr(load_format, "initializes_randomly", False):
        initialize_randomly(model, seed=config.model.seed or 0)
        logger.info("dummy weights: parameters initialised randomly (seed %s)", config.model.seed or 0)
    else:
        with torch.inference_mode():
            weights = load_format.iterate_weights(info.path, config.model, config.load)
            loaded = model.load_weights(timed_iteration(weights, reading))
        missing = sorted({name for name, _ in model.named_parameters()} - set(loaded))
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ModelLoadError(f"the files at {info.path} have no weights for {shown}")
    platform.finish_loading(model)
    loading = time.perf_counter() - built
    logger.info(
        "model %s built in %.2fs, weights loaded in %.2fs: reading the checkpoint %.2fs, placing and "
        "packing them %.2fs (dtype %s, quantization %s)",
        info.architecture,
        built - started,
        loading,
        reading[0],
        loading - reading[0],
        dtype,
        info.quantization or "none",
    )
    return model, dtype


def timed_iteration(items: Any, seconds: list[float]) -> Any:
    """``items`` unchanged, the time spent producing them added to ``seconds[0]`` (the start-up
    log's split of loading between the load format and the model's own processing)."""
    iterator = iter(items)
    while True:
        started = time.perf_counter()
        try:
            item = next(iterator)
        except StopIteration:
            seconds[0] += time.perf_counter() - started
            return
        seconds[0] += time.perf_counter() - started
        yield item


def initialize_randomly(model: Any, seed: int) -> None:
    """Small random values for every parameter (``--load-format dummy``: profiling only)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            values = torch.empty(parameter.shape, dtype=torch.float32).uniform_(-1e-2, 1e-2, generator=generator)
            parameter.copy_(values.to(parameter.dtype))
