"""The built-in logits processors, registered the way a third-party plugin registers its own
(requests name them in ``logits_processors``); lazily: loading this plugin imports none."""

from __future__ import annotations

from tokenloom.plugin_api import hookimpl

_PACKAGE = "tokenloom.builtin_plugins.logits_processors"

LOGITS_PROCESSORS = {
    "no_repeat_ngram": "no_repeat_ngram:NoRepeatNGramLogitsProcessor",
}


@hookimpl
def register_logits_processors(register):
    for name, target in LOGITS_PROCESSORS.items():
        register(name, f"{_PACKAGE}.{target}")
