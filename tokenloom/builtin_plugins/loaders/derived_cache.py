"""A disk cache of what tokenloom derives from a model file and could always derive again (the
tokenizer a GGUF file's metadata describes), under ``$TOKENLOOM_CACHE_DIR`` (default
``~/.cache/tokenloom``), one sub-directory per kind of entry.

An entry is one file named by its key: a digest of everything the entry is derived from, the
deriving code's version included, so an entry is only ever found by the inputs that made it.
The file is a one-line JSON header (file format, key, the payload's length and SHA-256, and the
caller's small JSON fields), a newline, then the payload bytes. A read trusts nothing: a file
whose header, length or digest does not match is a miss, logged, and the caller's rebuild
replaces it. A write goes to a temporary file in the same directory, renamed over the entry,
so a reader, or a second server writing the same entry at the same moment, sees the old file
or the new one, never part of one. (No fsync: a file torn by a power cut fails its digest.)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "TOKENLOOM_CACHE_DIR"
FILE_FORMAT = "tokenloom-derived-cache/1"


def cache_root() -> Path:
    """``$TOKENLOOM_CACHE_DIR``, else ``~/.cache/tokenloom`` (where the CPU kernels are cached too)."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "tokenloom")


@dataclass(frozen=True)
class CacheEntry:
    """A sound entry: the fields and payload its writer stored."""

    fields: dict[str, Any]
    payload: bytes


class DerivedCache:
    """Entries of one kind (``kind`` is the sub-directory): :meth:`read` and :meth:`write` by key."""

    def __init__(self, kind: str, root: str | os.PathLike | None = None):
        self.directory = Path(root if root is not None else cache_root()) / kind

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.entry"

    def read(self, key: str) -> CacheEntry | None:
        """The entry stored under ``key``, or None when there is none or it is not sound."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.warning("cannot read cache entry %s (%s); building it again", path, exc)
            return None
        header_end = data.find(b"\n")
        problem = "has no header line" if header_end < 0 else None
        header: Any = None
        if problem is None:
            try:
                header = json.loads(data[:header_end])
            except ValueError:
                problem = "has a header that is not JSON"
        payload = data[header_end + 1 :]
        if problem is None:
            problem = _header_problem(header, key, payload)
        if problem is not None:
            logger.warning("cache entry %s %s; building it again", path, problem)
            return None
        return CacheEntry(fields=header["fields"], payload=payload)

    def write(self, key: str, payload: bytes, fields: dict[str, Any] | None = None) -> Path | None:
        """Store ``payload`` and ``fields`` (JSON-able) under ``key``, replacing any entry
        atomically; returns the entry's path, or None when it could not be written (a
        read-only or full disk: logged, and the caller carries on without the cache)."""
        header = json.dumps(
            {
                "format": FILE_FORMAT,
                "key": key,
                "payload_bytes": len(payload),
                "payload_sha256": hashlib.sha256(payload).hexdigest(),
                "fields": fields or {},
            }
        )  # json.dumps escapes newlines: the header stays one line
        path = self.path(key)
        temporary = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.", suffix=".tmp")
            with os.fdopen(handle, "wb") as file:
                file.write(header.encode("ascii") + b"\n")
                file.write(payload)
            os.replace(temporary, path)
            return path
        except OSError as exc:
            logger.warning("cannot write cache entry %s (%s); the next start builds it again", path, exc)
            if temporary is not None:
                try:
                    os.unlink(temporary)
                except OSError:
                    pass
            return None


def _header_problem(header: Any, key: str, payload: bytes) -> str | None:
    """Why an entry with this header and payload cannot be trusted, or None."""
    if not isinstance(header, dict) or header.get("format") != FILE_FORMAT:
        return f"is not in format {FILE_FORMAT}"
    if header.get("key") != key:
        return f"holds key {header.get('key')!r}, not {key!r}"
    if not isinstance(header.get("fields"), dict):
        return "has no fields"
    if header.get("payload_bytes") != len(payload):
        return f"is truncated or padded ({len(payload)} payload bytes, {header.get('payload_bytes')} written)"
    if header.get("payload_sha256") != hashlib.sha256(payload).hexdigest():
        return "is corrupt (its payload does not match its SHA-256)"
    return None
