"""Registers the BERT encoder (``BertModel``) as a pooling model: embeddings and similarity
scores, never generation. The class lives in
:mod:`~tokenloom.builtin_plugins.models.modeling_bert`, imported by name when a worker
builds the model: this entry-point module stays free of torch, so listing plugins is fast."""

from __future__ import annotations

from tokenloom.plugin_api import hookimpl


@hookimpl
def register_models(register):
    register("BertModel", "tokenloom.builtin_plugins.models.modeling_bert:BertModel", runner="pooling")
