"""``KVEventsConfig``: KV-cache events from ``--kv-events-config`` (vLLM's JSON keys and
defaults)."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any

from tokenloom.errors import ConfigError

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
