"""What :class:`~tokenloom.core.engine.llm_engine.LLMEngine` decides and checks before any worker
starts: the device platform (``--device auto``), the executor (``uni``, ``mp``, or the
``--distributed-executor-backend`` choice), the speculative-decoding proposer (its name, then
its own checks against the resolved target model) and the worst-case media a profile run
encodes (:func:`profile_multimodal_items`).
"""

from __future__ import annotations

from typing import Any

from tokenloom.core.config import EngineConfig, ParallelConfig
from tokenloom.core.model_loader import ModelInfo
from tokenloom.errors import ConfigError, EngineDeadError
from tokenloom.plugins.manager import PluginSet

# methods vLLM has that need trained heads or layers: refused by name unless a plugin registers
# them (tokenloom's own proposers are ngram and draft_model)
DRAFT_MODEL_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "deepseek_mtp")


def check_proposer(config: EngineConfig, plugins: PluginSet) -> None:
    """The ``--speculative-config`` method names a registered proposer (before the model loads)."""
    speculative = config.speculative
    if speculative is None:
        return
    registry = plugins.registry("proposer")
    if speculative.method in DRAFT_MODEL_METHODS and speculative.method not in registry.names():
        raise ConfigError(
            f"--speculative-config: method {speculative.method!r} is not implemented yet; use a registered "
            f'proposer: {", ".join(registry.names()) or "none"} ("ngram": prompt lookup, "draft_model": a smaller model)',
            param="speculative-config",
        )
    registry.entry(speculative.method)


def choose_executor(parallel: ParallelConfig) -> str:
    """The executor plugin's name: ``--distributed-executor-backend`` when given, else vLLM's
    rule: ``mp`` (worker processes) for several workers, ``uni`` for one."""
    if parallel.distributed_executor_backend:
        return parallel.distributed_executor_backend
    return "mp" if parallel.world_size > 1 else "uni"


def check_proposer_model(config: EngineConfig, plugins: PluginSet, model_info: ModelInfo, tokenizer: Any) -> int:
    """The proposer's own checks against the resolved target (e.g. a draft model's
    vocabulary), in the main process before any worker starts. Returns the lookahead slots the
    scheduler allocates for it."""
    speculative = config.speculative
    if speculative is None:
        return 0
    from tokenloom.core.spec_decode.proposer import ProposerSpec

    proposer_class = plugins.registry("proposer").get(speculative.method)
    proposer_class.check(ProposerSpec(speculative, config, model_info, plugins=plugins), tokenizer)
    return int(proposer_class.lookahead_slots(speculative))


def choose_platform(name: str, plugins: PluginSet) -> str:
    """The device platform plugin's name: ``name`` itself (checked to exist), or for ``auto``
    the available platform of highest ``auto_priority`` (a GPU before the CPU), the first
    registered among equals."""
    registry = plugins.registry("platform")
    if name != "auto":
        registry.entry(name)
        return name
    ranked = sorted(registry.entries(), key=lambda entry: -getattr(entry.resolve(), "auto_priority", 0))
    for entry in ranked:
        if entry.resolve().is_available():
            return str(entry.name)
    raise EngineDeadError(f"no available device platform among {', '.join(registry.names()) or 'none'}")


def profile_multimodal_items(plugins: PluginSet, platform: str, model_info: ModelInfo, tokenizer: Any) -> list[Any]:
    """The worst-case media items of a model that sees (its registered processor's
    :func:`~tokenloom.core.multimodal.processor.worst_case_items`), for the profile run of a
    platform that profiles activations, whose peak then holds the vision encoder's; none for a
    text-only model, without a tokenizer, or on a platform that measures no activations."""
    from tokenloom.core.multimodal.processor import ProcessorContext, worst_case_items
    from tokenloom.plugins.registry import resolve_target

    platform_class = plugins.registry("platform").get(platform)
    if not getattr(platform_class, "profiles_activations", False) or model_info.runner != "generate":
        return []
    models = plugins.registry("model")
    if tokenizer is None or model_info.architecture not in models:
        return []
    target = models.entry(model_info.architecture).options.get("multimodal_processor")
    if target is None:
        return []
    processor_class = resolve_target(target) if isinstance(target, str) else target
    processor = processor_class(ProcessorContext(model_info.hf_config, model_info.path, tokenizer, {}))
    return worst_case_items(processor)
