"""``--kv-transfer-config``: which KV connector (``register_kv_connectors``) the engine runs, in
which role, with what options, in vLLM's JSON shape::

    {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"shared_storage_path": "/var/cache/tokenloom-kv"}}

Only the shape is checked here; the connector checks its own ``kv_connector_extra_config``
when it is built, and the engine checks the name against the registry before the model loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenloom.errors import ConfigError

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """A KV connector and its role: ``kv_producer`` only stores the blocks it computes,
    ``kv_consumer`` only loads, ``kv_both`` (the default) does both."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def loads(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def saves(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @classmethod
    def from_dict(cls, options: Any) -> KVTransferConfig:
        """vLLM's ``--kv-transfer-config`` object -> a checked config; a ConfigError names the key."""
        if not isinstance(options, dict):
            raise _bad(f"must be a JSON object, got {type(options).__name__}")
        known = ("kv_connector", "kv_role", "kv_connector_extra_config")
        for key in options:
            if key not in known:
                raise _bad(f"unknown key {key!r}; tokenloom reads {', '.join(known)}")
        name = options.get("kv_connector")
        if not isinstance(name, str) or not name:
            raise _bad('kv_connector must name a connector, e.g. "SharedStorageConnector"')
        role = options.get("kv_role", "kv_both")
        if role not in KV_ROLES:
            raise _bad(f"kv_role must be one of {', '.join(KV_ROLES)}, got {role!r}")
        extra = options.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise _bad(f"kv_connector_extra_config must be a JSON object, got {type(extra).__name__}")
        return cls(name, role, dict(extra))


def _bad(message: str) -> ConfigError:
    return ConfigError(f"--kv-transfer-config: {message}", param="kv-transfer-config")
