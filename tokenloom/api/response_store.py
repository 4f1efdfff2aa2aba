"""Stored responses of /v1/responses (``store``, ``previous_response_id``, GET, DELETE, cancel of
``background`` ones): in this server's memory, each visible only to its API key, bounded in
entries and in bytes with the least recently used dropped first, and lost on restart.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from tokenloom.api.responses_protocol import ResponseObject
from tokenloom.errors import NotFoundError

STORE_SIZE_ENV = "TOKENLOOM_RESPONSES_STORE_SIZE"
DEFAULT_STORE_SIZE = 1000
# ServerConfig.responses_store_max_bytes' default, for stores built without a config
DEFAULT_STORE_MAX_BYTES = 128 * 1024 * 1024


def store_size_from_env() -> int:
    raw = os.environ.get(STORE_SIZE_ENV)
    if not raw:
        return DEFAULT_STORE_SIZE
    try:
        size = int(raw)
    except ValueError:
        size = -1
    if size < 0:
        from tokenloom.errors import ConfigError

        raise ConfigError(
            f"{STORE_SIZE_ENV} must be a whole number >= 0 (0 stores nothing), got {raw!r}", param=STORE_SIZE_ENV
        )
    return size


def owner_of(raw_request: Request, keys_in_use: bool) -> str | None:
    """Whose stored responses a request may see: a digest of its API key, when keys are in use
    (the middleware has checked the key already)."""
    if not keys_in_use:
        return None
    header = raw_request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    key = token.strip() if scheme.lower() == "bearer" else raw_request.headers.get("x-api-key", "")
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class StoredResponse:
    response: ResponseObject
    # the conversation so far without the instructions (which do not carry over), this output included
    messages: list[dict[str, Any]]
    owner: str | None
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    def num_bytes(self) -> int:
        """The entry's size as the store counts it: its response and its conversation as JSON
        (UTF-8 bytes), which is what a client can make large (input, instructions, tools,
        metadata, text.format, reasoning, the output, a chain of previous turns)."""
        response = self.response.model_dump_json().encode()
        messages = json.dumps(self.messages, ensure_ascii=False, default=str).encode()
        return len(response) + len(messages)


class ResponseStore:
    """Stored responses by id, least recently used dropped first beyond ``max_entries``
    entries or ``max_bytes`` bytes (:meth:`StoredResponse.num_bytes`, measured when stored)."""

    def __init__(self, max_entries: int, max_bytes: int = DEFAULT_STORE_MAX_BYTES):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self._sizes: dict[str, int] = {}
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> bool:
        """Store ``entry`` (replacing one with its id), dropping the least recently used beyond
        the bounds; False, and nothing kept under its id, when it alone exceeds ``max_bytes``
        (or the store keeps no entries)."""
        response_id = entry.response.id
        size = entry.num_bytes()
        self._forget(response_id)
        if size > self.max_bytes or self.max_entries < 1:
            return False
        self._entries[response_id] = entry
        self._sizes[response_id] = size
        self.num_bytes += size
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            dropped_id = next(iter(self._entries))
            dropped = self._entries[dropped_id]
            self._forget(dropped_id)
            if dropped.task is not None and not dropped.task.done():
                dropped.task.cancel()
        return True

    def _forget(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.pop(response_id, None)
        self.num_bytes -= self._sizes.pop(response_id, 0)
        return entry

    def get(self, response_id: str, owner: str | None, param: str = "response_id") -> StoredResponse:
        entry = self._entries.get(response_id)
        # another key's response is as absent as a missing one: its existence is not shown
        if entry is None or entry.owner != owner:
            raise NotFoundError(
                f"no stored response {response_id!r} (responses live in this server's memory: a "
                "restart, store: false or the store's size limit loses them)",
                param=param,
            )
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, owner: str | None) -> StoredResponse:
        entry = self.get(response_id, owner)
        self._forget(response_id)
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()
        return entry
