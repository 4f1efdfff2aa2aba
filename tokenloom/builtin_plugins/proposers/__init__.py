"""Built-in speculative-decoding proposers: ``ngram`` (prompt lookup) and ``draft_model`` (a
smaller model with the target's tokenizer)."""

from __future__ import annotations

from tokenloom.plugin_api import hookimpl


@hookimpl
def register_proposers(register):
    register("ngram", "tokenloom.builtin_plugins.proposers.ngram:NgramProposer")
    register("draft_model", "tokenloom.builtin_plugins.proposers.draft_model:DraftModelProposer")
