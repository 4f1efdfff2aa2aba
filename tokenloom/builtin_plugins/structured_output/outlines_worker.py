"""The child process that builds outlines-core indexes for the ``outlines`` backend, so a
compile past its time limit is killed instead of burning a thread for as long as it runs
(a regex such as ``(a|b)*a(a|b){15}`` takes exponential time). It imports nothing of tokenloom.

Run as ``python -m tokenloom.builtin_plugins.structured_output.outlines_worker``; it talks in
length-prefixed pickles over stdin and stdout: first the ``Vocabulary``, then per job a
``(kind, text, whitespace_pattern)`` (kind ``regex`` or ``json``), answered by ``("ok",
Index)`` or ``("error", message)``. It ends when its stdin closes (its parent went away).
"""

from __future__ import annotations

import pickle
import struct
import sys
from typing import IO, Any

HEADER = struct.Struct("<Q")


def write_message(stream: IO[bytes], value: Any) -> None:
    payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(payload)) + payload)
    stream.flush()


def read_message(stream: IO[bytes]) -> Any:
    """The next message; EOFError when the other side closed the pipe."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        raise EOFError
    (size,) = HEADER.unpack(header)
    payload = stream.read(size)
    if len(payload) < size:
        raise EOFError
    return pickle.loads(payload)


def build(vocabulary: Any, kind: str, text: str, whitespace_pattern: str | None) -> Any:
    from outlines_core import Index
    from outlines_core.json_schema import build_regex_from_schema

    regex = build_regex_from_schema(text, whitespace_pattern) if kind == "json" else text
    return Index(regex, vocabulary)


def main() -> None:
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    try:
        vocabulary = read_message(requests)
        while True:
            kind, text, whitespace_pattern = read_message(requests)
            try:
                reply = ("ok", build(vocabulary, kind, text, whitespace_pattern))
            except Exception as exc:  # the parent turns it into the request's 400
                reply = ("error", f"{type(exc).__name__}: {exc}")
            write_message(replies, reply)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return


if __name__ == "__main__":
    main()
