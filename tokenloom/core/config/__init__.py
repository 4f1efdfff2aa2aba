"""Typed engine configuration, one module per section as vLLM's config package has it
(``model``, ``cache``, ``scheduler``, ``parallel``, ``device``, ``load``, ``structured_output``,
``lora``, ``speculative``, ``kv_events``, ``kv_transfer``), and ``engine``: :class:`EngineConfig`, the sections
together, and :class:`EngineArgs`, the flat engine arguments by their vLLM names.

Import the classes from here (``from tokenloom.core.config import EngineArgs``), the one path
the rest of tokenloom and its users name. Attribute docstrings (the string literal under each
field) are the CLI help texts.
"""

from tokenloom.core.config.cache import CacheConfig
from tokenloom.core.config.device import DeviceConfig
from tokenloom.core.config.engine import (
    CONFIG_GROUPS,
    ENGINE_ARG_GROUPS,
    JSON_CONFIG_ARGS,
    STRUCTURED_OUTPUT_ARGS,
    EngineArgs,
    EngineConfig,
    validate_engine_config,
)
from tokenloom.core.config.kv_events import KVEventsConfig
from tokenloom.core.config.kv_transfer import KVTransferConfig
from tokenloom.core.config.load import LoadConfig
from tokenloom.core.config.lora import LoRAConfig
from tokenloom.core.config.model import ModelConfig
from tokenloom.core.config.parallel import ParallelConfig
from tokenloom.core.config.scheduler import SchedulerConfig
from tokenloom.core.config.speculative import SpeculativeConfig
from tokenloom.core.config.structured_output import StructuredOutputConfig

__all__ = [
    "CONFIG_GROUPS",
    "ENGINE_ARG_GROUPS",
    "JSON_CONFIG_ARGS",
    "STRUCTURED_OUTPUT_ARGS",
    "CacheConfig",
    "DeviceConfig",
    "EngineArgs",
    "EngineConfig",
    "KVEventsConfig",
    "KVTransferConfig",
    "LoRAConfig",
    "LoadConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "StructuredOutputConfig",
    "validate_engine_config",
]
