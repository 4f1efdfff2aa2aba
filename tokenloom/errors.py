"""The exception hierarchy; the server maps each class to one HTTP status in one handler.

Invalid input raises :class:`InvalidRequestError` (400) naming the parameter; nothing in
tokenloom uses ``assert`` to check input.
"""

from __future__ import annotations

import difflib


class TokenloomError(Exception):
    """Base of every error tokenloom raises on purpose."""

    status_code = 500
    error_type = "InternalServerError"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(TokenloomError, ValueError):
    """The request (or a sampling parameter) is invalid: 400, the message says what to change."""

    status_code = 400
    error_type = "BadRequestError"


class ContextLengthError(InvalidRequestError):
    """The prompt (plus requested tokens) does not fit the model's context: 400."""


class NotFoundError(TokenloomError):
    """Unknown model or resource: 404."""

    status_code = 404
    error_type = "NotFoundError"


class UnauthorizedError(TokenloomError):
    """Missing or wrong API key: 401."""

    status_code = 401
    error_type = "AuthenticationError"


class OverloadedError(TokenloomError):
    """Too many requests waiting: 429."""

    status_code = 429
    error_type = "RateLimitError"


class EngineDeadError(TokenloomError):
    """The engine stopped (or is not ready): 503."""

    status_code = 503
    error_type = "ServiceUnavailableError"


class ConfigError(TokenloomError, ValueError):
    """A bad command-line flag, config file or engine argument (start-up, not per request)."""

    status_code = 400
    error_type = "BadRequestError"


class NotImplementedFlagError(ConfigError):
    """A vLLM flag tokenloom knows by name but does not implement yet."""


class PluginError(TokenloomError):
    """A plugin could not be loaded or registered something invalid."""


class UnknownNameError(ConfigError, LookupError):
    """A name that no plugin registered (model architecture, parser, load format, ...)."""

    def __init__(self, kind: str, name: str, known: list[str], *, flag: str | None = None, hint: str = ""):
        suggestion = closest_match(name, known)
        parts = [f"unknown {kind} {name!r}" + (f" (for {flag})" if flag else "")]
        parts.append("registered: " + (", ".join(sorted(known)) if known else "none"))
        if suggestion:
            parts.append(f"did you mean {suggestion!r}?")
        if hint:
            parts.append(hint)
        super().__init__("; ".join(parts), param=flag)
        self.kind = kind
        self.name = name
        self.known = known
        self.suggestion = suggestion


class ModelLoadError(TokenloomError):
    """Model files are missing, corrupt or of a kind no plugin loads; the message names the file."""


def closest_match(name: str, known: list[str]) -> str | None:
    """The known name ``name`` most likely misspells (or differs from only in case), or None."""
    matches = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    if not matches:
        lowered = {k.lower(): k for k in known}
        matches = [lowered[name.lower()]] if name.lower() in lowered else []
    return matches[0] if matches else None
