"""GPT-2's byte-level alphabet, which byte-level BPE vocabularies spell their tokens in:
shared by what builds a tokenizer from a vocabulary (the GGUF loader) and what needs each
token's bytes (the guided-decoding backends), neither of which may import the other."""

from __future__ import annotations

import functools


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (cached: callers only read it)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    characters = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, characters)))
