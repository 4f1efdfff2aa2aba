"""``StructuredOutputConfig``: guided decoding's default backend, its options, and which
backends a request may choose."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StructuredOutputConfig:
    backend: str = "auto"
    """Default guided-decoding backend; ``auto`` picks per request. vLLM's option syntax
    (``xgrammar:disable-any-whitespace``) is accepted."""
    disable_fallback: bool = False
    """Do not fall back to another backend when the chosen one cannot express a request."""
    disable_any_whitespace: bool = False
    """Generate JSON without optional whitespace."""
    disable_additional_properties: bool = False
    """Treat JSON schemas as if ``additionalProperties: false``."""
    reasoning_parser: str | None = None
    """The reasoning parser, so constraints start after the reasoning section."""
    compile_timeout: float = 30.0
    """Seconds one guided-decoding constraint may take to compile; a slower one (say a JSON
    schema with a huge maxLength) fails its request with a 400 and the compile pool goes on
    with a fresh thread."""
    request_backends: str = "any"
    """Which guided-decoding backends a request may choose (``backend`` in
    ``structured_outputs``, or ``guided_decoding_backend``): ``any``; ``none``, only the server's
    own backend (vLLM's behaviour: a request naming another gets a 400); or a comma-separated
    list of backend names it may name besides the server's."""
