"""A test-only model plugin: ``ScriptedForCausalLM`` replays scripted token sequences, so the
whole server path (chat template, tokenizer, engine, detokenizer, parsers, streaming) can be
tested end to end with each parser's real output format. Load it with
``tokenloom serve MODEL_DIR --plugin tests.plugins.scripted_model``, where MODEL_DIR is made
by :func:`tests.plugins.scripted_model.model_dir.write_model_dir`."""

from tokenloom.plugin_api import hookimpl


@hookimpl
def register_models(register):
    register("ScriptedForCausalLM", "tests.plugins.scripted_model.model:ScriptedForCausalLM")
