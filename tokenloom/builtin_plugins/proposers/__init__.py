"""Built-in speculative-decoding proposers: ``ngram`` (prompt lookup)."""

from __future__ import annotations

from tokenloom.plugin_api import hookimpl


@hookimpl
def register_proposers(register):
    register("ngram", "tokenloom.builtin_plugins.proposers.ngram:NgramProposer")
