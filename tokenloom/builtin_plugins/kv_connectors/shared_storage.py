"""``SharedStorageConnector``: KV-cache blocks as files in a directory (vLLM's connector of that
name), so a prefix survives restarts and a prefill instance (``kv_producer``) hands its blocks
to a decode instance (``kv_consumer``) on the same machine or a shared file system.

``kv_connector_extra_config``: ``shared_storage_path`` (the directory, created if missing) and
``max_bytes`` (the bound on the block files under it, default 16 GiB; the least recently used
blocks go first).

Layout: ``DIR/<namespace>/<first two hex digits>/<block hash hex>.kvblock``, where the
namespace digests the model, its weights, dtypes, block layout and tokenizer (``manifest.json``
beside the blocks says which), so a block of another model is never even looked up. A file is
``MAGIC``, a 4-byte big-endian header length, a JSON header (namespace, block hash, dtype,
shape, payload length, sha256 of the payload) and the payload (the block's tensor bytes). It is
written to a temporary name, fsynced and renamed into place, so a reader sees a whole file or
none; a file that fails any check on load (truncated, corrupted, another namespace or layout)
is deleted and its block recomputed, and storing a block over a file of the wrong size
replaces it. Loading or re-storing a block refreshes its mtime, the
LRU order eviction follows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from tokenloom.errors import ConfigError
from tokenloom.plugin_api import KVBlockCorruptError, KVConnector, KVConnectorContext

logger = logging.getLogger(__name__)

MAGIC = b"TOKENLOOM-KV\x01"
HEADER_LENGTH_BYTES = 4
BLOCK_SUFFIX = ".kvblock"
DEFAULT_MAX_BYTES = 16 * 2**30
# eviction frees down to this share of max_bytes, so it runs once per many stores, not per store
EVICT_TO_SHARE = 0.9


class SharedStorageConnector(KVConnector):
    def __init__(self, context: KVConnectorContext):
        super().__init__(context)
        extra = dict(context.extra_config)
        path = extra.pop("shared_storage_path", None)
        max_bytes = extra.pop("max_bytes", DEFAULT_MAX_BYTES)
        if extra:
            raise _bad(
                f"unknown kv_connector_extra_config key(s) {', '.join(sorted(extra))}; known: shared_storage_path, max_bytes"
            )
        if not isinstance(path, str) or not path:
            raise _bad('kv_connector_extra_config needs "shared_storage_path": the directory to keep KV blocks in')
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
            raise _bad(f"max_bytes must be a whole number of bytes of at least 1, got {max_bytes!r}")
        self.root = os.path.abspath(path)
        self.max_bytes = max_bytes
        self.directory = os.path.join(self.root, context.namespace)
        try:
            os.makedirs(self.directory, exist_ok=True)
            self._write_manifest()
        except OSError as exc:
            raise _bad(f"shared_storage_path {path!r} is not a writable directory: {exc}") from exc
        self._lock = threading.Lock()
        # bytes of block files under root (every namespace): counted on the first store
        self._total_bytes: int | None = None

    def describe(self) -> str:
        return f"blocks in {self.directory} (at most {self.max_bytes} bytes under {self.root}, LRU)"

    # -- scheduler side -----------------------------------------------------------------------

    def num_stored_blocks(self, block_hashes: Sequence[bytes]) -> int:
        for count, block_hash in enumerate(block_hashes):
            if not os.path.exists(self._path(block_hash)):
                return count
        return len(block_hashes)

    # -- worker side --------------------------------------------------------------------------

    def load_block(self, block_hash: bytes) -> torch.Tensor | None:
        path = self._path(block_hash)
        try:
            with open(path, "rb") as file:
                data = bytearray(os.fstat(file.fileno()).st_size)
                num_read = file.readinto(data)
        except FileNotFoundError:
            return None  # evicted since the lookup
        try:
            kv = self._decode(data, num_read, block_hash)
        except KVBlockCorruptError:
            _remove(path)  # recomputed and stored again
            raise
        _touch(path)
        return kv

    def save_block(self, block_hash: bytes, kv: torch.Tensor) -> int:
        path = self._path(block_hash)
        payload = kv.contiguous().reshape(-1).view(torch.uint8).numpy()
        header = json.dumps(
            {
                "namespace": self.context.namespace,
                "block_hash": block_hash.hex(),
                "dtype": str(kv.dtype).removeprefix("torch."),
                "shape": list(kv.shape),
                "payload_bytes": payload.nbytes,
                "sha256": hashlib.sha256(payload).hexdigest(),
            }
        ).encode("utf-8")
        size = len(MAGIC) + HEADER_LENGTH_BYTES + len(header) + payload.nbytes
        if _size(path) == size:
            _touch(path)  # stored already (a file of another size is a torn one: replaced)
            return 0
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"
        try:
            with open(temporary, "wb") as file:
                file.write(MAGIC)
                file.write(len(header).to_bytes(HEADER_LENGTH_BYTES, "big"))
                file.write(header)
                file.write(payload)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        except BaseException:
            _remove(temporary)
            raise
        self._account(size)
        return size

    # -- internals ------------------------------------------------------------------------------

    def _path(self, block_hash: bytes) -> str:
        name = block_hash.hex()
        return os.path.join(self.directory, name[:2], name + BLOCK_SUFFIX)

    def _decode(self, data: bytearray, num_read: int, block_hash: bytes) -> torch.Tensor:
        start = len(MAGIC) + HEADER_LENGTH_BYTES
        if num_read != len(data) or num_read < start or bytes(data[: len(MAGIC)]) != MAGIC:
            raise KVBlockCorruptError("not a whole tokenloom KV block file")
        header_end = start + int.from_bytes(data[len(MAGIC) : start], "big")
        try:
            header: dict[str, Any] = json.loads(bytes(data[start:header_end]))
            dtype = getattr(torch, header["dtype"])
            shape = [int(size) for size in header["shape"]]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise KVBlockCorruptError(f"unreadable header: {exc}") from exc
        if header.get("namespace") != self.context.namespace or header.get("block_hash") != block_hash.hex():
            raise KVBlockCorruptError("written for another model or block")
        payload = memoryview(data)[header_end:]
        if len(payload) != header.get("payload_bytes"):
            raise KVBlockCorruptError(f"truncated: {len(payload)} payload bytes of {header.get('payload_bytes')}")
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            raise KVBlockCorruptError("checksum mismatch")
        return torch.frombuffer(data, dtype=torch.uint8, offset=header_end).view(dtype).reshape(shape)

    def _account(self, num_bytes: int) -> None:
        with self._lock:
            if self._total_bytes is None:
                self._total_bytes = sum(size for _, size, _ in self._block_files())
            else:
                self._total_bytes += num_bytes
            if self._total_bytes > self.max_bytes:
                self._evict()

    def _evict(self) -> None:
        """Delete the least recently used block files (every namespace under root) until they
        take at most ``EVICT_TO_SHARE`` of ``max_bytes``; the total is recounted on the way."""
        files = sorted(self._block_files())
        total = sum(size for _, size, _ in files)
        target = int(self.max_bytes * EVICT_TO_SHARE)
        for _, size, path in files:
            if total <= target:
                break
            if _remove(path):
                total -= size
        self._total_bytes = total

    def _block_files(self) -> list[tuple[float, int, str]]:
        """(mtime, size, path) of every block file under root."""
        files = []
        for directory, _, names in os.walk(self.root):
            for name in names:
                if name.endswith(BLOCK_SUFFIX):
                    path = os.path.join(directory, name)
                    try:
                        stat = os.stat(path)
                    except FileNotFoundError:
                        continue
                    files.append((stat.st_mtime, stat.st_size, path))
        return files

    def _write_manifest(self) -> None:
        path = os.path.join(self.directory, "manifest.json")
        if os.path.exists(path):
            return
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w", encoding="utf-8") as file:
            json.dump(self.context.namespace_parts, file, indent=1, sort_keys=True)
        os.replace(temporary, path)


def _touch(path: str) -> None:
    try:
        os.utime(path)
    except FileNotFoundError:
        pass


def _size(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return None


def _remove(path: str) -> bool:
    try:
        os.remove(path)
    except FileNotFoundError:
        return False
    return True


def _bad(message: str) -> ConfigError:
    return ConfigError(f"--kv-transfer-config: SharedStorageConnector: {message}", param="kv-transfer-config")
