"""Every tokenloom hook, one per plugin kind: the contract plugin authors implement.

Each hook receives a ``register(name, target, **options)`` callback. ``target`` is a class,
a factory, or a lazy ``"module:attr"`` string imported on first use. ``register`` validates
the name and records which plugin gave it; a duplicate name is an error naming both plugins
unless ``override=True`` is passed.

All hooks are called once, by :func:`tokenloom.plugins.manager.load_plugins`, in the main
process, when the CLI or ``LLM(...)`` starts. Worker processes never call them: they
receive the resolved registries as plain data (name -> ``"module:attr"``).
"""

from __future__ import annotations

from typing import Any, Protocol

import pluggy

PROJECT_NAME = "tokenloom"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class Register(Protocol):
    """The callback every hook receives: ``register(name, target, *, override=False, **options)``.

    ``name`` is what flags and requests choose by; ``target`` is a class, a factory or a lazy
    ``"module:attr"`` string (imported on first use, and checked before the model loads when
    a flag selects it). ``override=True`` replaces a name another plugin registered, on
    purpose; otherwise a duplicate name is an error that names both plugins. ``options`` are
    kept with the entry for the kind's consumer (e.g. ``public_paths`` for API routes).
    """

    def __call__(self, name: str, target: Any, *, override: bool = False, **options: Any) -> None: ...


# -- what runs the model ---------------------------------------------------------------


@hookspec
def register_platforms(register: Register) -> None:
    """Register device platforms (where tensors live and which attention backend runs).

    :param register: ``register(name, target)``; ``target`` resolves to a
        :class:`tokenloom.plugin_api.Platform` subclass.
    :returns: nothing.

    Called once in the main process at plugin load. The engine picks the platform named by
    ``--device`` (``auto``: the available platform of highest ``auto_priority``, the first
    registered among equals).
    """


@hookspec
def register_attention_backends(register: Register) -> None:
    """Register paged attention backends: the kernels a model's ``Attention`` layers run.

    :param register: ``register(name, target, aliases=(...))``; ``target`` resolves to a class
        with the interface of :class:`tokenloom.kernels.paged_attention.TorchPagedAttention`
        (constructed with no arguments, once per worker); ``aliases`` are other spellings of
        the name that ``--attention-backend`` and ``VLLM_ATTENTION_BACKEND`` accept (vLLM's,
        such as ``TORCH_SDPA``), matched in any case.
    :returns: nothing.

    Called once in the main process at plugin load. ``--attention-backend`` (or
    TOKENLOOM_ATTENTION_BACKEND / VLLM_ATTENTION_BACKEND) names a backend; ``auto`` takes the
    one the platform names in ``Platform.attention_backend()``. A platform plugin registers the
    backends its devices run.
    """


@hookspec
def register_executors(register: Register) -> None:
    """Register executors: what owns the workers that run the model.

    :param register: ``register(name, target)``; ``target`` resolves to a
        :class:`tokenloom.plugin_api.Executor` subclass.
    :returns: nothing.

    Called once in the main process at plugin load. ``--distributed-executor-backend``
    names the executor (by default ``uni`` for one worker, ``mp`` when ``tp * pp > 1``). The executor is constructed in the main
    process as ``Executor(spec)`` with a :class:`tokenloom.plugin_api.WorkerSpec` (the engine
    config, the model's info, the platform's name and the resolved plugin tables: plain data);
    it starts whatever workers it owns and ships them that spec, never re-running discovery.
    """


@hookspec
def register_proposers(register: Register) -> None:
    """Register speculative-decoding proposers: what drafts tokens for the target to verify.

    :param register: ``register(method, target)``; ``method`` is what ``--speculative-config``'s
        ``"method"`` names (``ngram`` is built in), ``target`` resolves to a
        :class:`tokenloom.plugin_api.Proposer` subclass.
    :returns: nothing.

    Called once in the main process at plugin load; the engine checks the method named by
    ``--speculative-config`` exists before the model loads. The proposer is constructed in
    each worker as ``Proposer(spec)`` with a :class:`tokenloom.plugin_api.ProposerSpec` and
    asked after every sampling step for at most ``num_speculative_tokens`` draft tokens per
    sequence (:class:`tokenloom.plugin_api.DraftRequest` in, :class:`tokenloom.plugin_api.Draft`
    out). Drafts are verified by rejection sampling, so a proposer only changes speed, never
    the output distribution; a draft that says which distribution it came from (``probs``)
    is verified against it, one without is taken as a deterministic choice.
    """


@hookspec
def register_kv_connectors(register: Register) -> None:
    """Register KV connectors: stores of KV-cache blocks outside the engine's own cache.

    :param register: ``register(name, target)``; ``name`` is what ``--kv-transfer-config``'s
        ``"kv_connector"`` names (``SharedStorageConnector`` is built in), ``target`` resolves to
        a :class:`tokenloom.plugin_api.KVConnector` subclass.
    :returns: nothing.

    Called once in the main process at plugin load; the engine checks the name before the model
    loads. The connector is constructed twice, as ``Connector(context)`` with a
    :class:`tokenloom.plugin_api.KVConnectorContext`: in the engine's process, where the
    scheduler asks ``num_stored_blocks`` for a new request's blocks past the local prefix-cache
    hit, and in the worker, where ``load_block`` and ``save_block`` run on the connector's own
    threads (loads before the request's first step, saves after the step that computed the
    block), never in the step's way.
    """


# -- what the model is -----------------------------------------------------------------


@hookspec
def register_models(register: Register) -> None:
    """Register model implementations by Hugging Face architecture name.

    :param register: ``register(architecture, target)``, e.g.
        ``register("LlamaForCausalLM", "my_pkg.llama:LlamaForCausalLM")``; ``target``
        resolves to an ``nn.Module`` class honouring :class:`tokenloom.plugin_api.ModelProtocol`.
        Options: ``runner="pooling"`` for an encoder; ``multimodal_processor=`` (a
        :class:`tokenloom.plugin_api.MultiModalProcessor` target) for a model that sees images.
    :returns: nothing.

    Called once in the main process at plugin load. The worker imports the class by its
    ``"module:Class"`` string when it builds the model; the architecture is chosen from
    the ``architectures`` field of the model's config.
    """


@hookspec
def register_load_formats(register: Register) -> None:
    """Register weight load formats (``--load-format``).

    :param register: ``register(name, target)``; ``target`` resolves to a
        :class:`tokenloom.plugin_api.LoadFormat` subclass.
    :returns: nothing.

    Called once in the main process at plugin load. ``--load-format auto`` asks each
    registered format, in registration order, whether it can load the model's files.
    """


@hookspec
def register_quantization_methods(register: Register) -> None:
    """Register quantization plugins (``--quantization``), by the name a checkpoint states.

    :param register: ``register(name, target)``; ``target`` resolves to a
        :class:`tokenloom.plugin_api.QuantizationConfig` subclass, built from the checkpoint,
        which gives each linear layer its :class:`tokenloom.plugin_api.QuantizationMethod`.
    :returns: nothing.

    Called once in the main process at plugin load. The checkpoint names its quantization
    (config.json's ``quantization_config.quant_method``, or a load format's, e.g. ``gguf``);
    ``--quantization`` is for checkpoints that name none, and is refused when it names another.
    """


@hookspec
def register_model_sources(register: Register) -> None:
    """Register model sources: turn a model tag into local files.

    :param register: ``register(name, target)``; ``target`` resolves to a
        :class:`tokenloom.plugin_api.ModelSource` subclass.
    :returns: nothing.

    Called once in the main process at plugin load. When ``tokenloom serve MODEL`` starts,
    each source is asked in registration order whether it recognises ``MODEL`` (a path, a
    Hugging Face repo id, a short name of a model shipped in a pip package...); the first
    that does resolves it to a local path.
    """


# -- what the server speaks ------------------------------------------------------------


@hookspec
def register_tool_parsers(register: Register) -> None:
    """Register tool-call parsers (``--tool-call-parser``).

    :param register: ``register(name, target)``; ``target`` resolves to a
        :class:`tokenloom.plugin_api.ToolParser` subclass.
    :returns: nothing.

    Called once in the main process at plugin load, including for files given with
    ``--tool-parser-plugin``. The server instantiates the named parser per request.
    """


@hookspec
def register_reasoning_parsers(register: Register) -> None:
    """Register reasoning parsers (``--reasoning-parser``).

    :param register: ``register(name, target)``; ``target`` resolves to a
        :class:`tokenloom.plugin_api.ReasoningParser` subclass.
    :returns: nothing.

    Called once in the main process at plugin load. The server instantiates the named parser
    per request to split ``reasoning_content`` from ``content``.
    """


@hookspec
def register_structured_output_backends(register: Register) -> None:
    """Register guided-decoding backends (``--guided-decoding-backend``).

    :param register: ``register(name, target)``; ``target`` resolves to a
        :class:`tokenloom.plugin_api.StructuredOutputBackend` subclass.
    :returns: nothing.

    Called once in the main process at plugin load. Backends compile a request's constraint
    into a matcher that the engine asks for an allowed-token mask each step.
    """


@hookspec
def register_logits_processors(register: Register) -> None:
    """Register logits processors that requests may name in ``logits_processors`` (and
    ``--logits-processors`` may apply to every request).

    :param register: ``register(name, target)``; ``target`` resolves to a class (or factory)
        whose instances honour :class:`tokenloom.plugin_api.LogitsProcessor`:
        ``processor(prompt_token_ids, output_token_ids, logits) -> logits``.
    :returns: nothing.

    Called once in the main process at plugin load. A request naming a registered processor
    (``"logits_processors": ["name"]`` or ``[{"qualname": "name", "args": [...], "kwargs":
    {...}}]``) gets its own instance, built in the worker with those arguments and called on
    its row of logits (float32, ``[vocab_size]``) at every step, before the built-in masks,
    biases and penalties. Registered names need no ``--logits-processor-pattern``: installing
    the plugin is the operator's consent.
    """


@hookspec
def register_api_routes(register: Register) -> None:
    """Register extra HTTP routes on the OpenAI-compatible server.

    :param register: ``register(name, target)``; ``target`` resolves to a callable
        ``target(app, engine_client) -> None`` that adds routes to the FastAPI ``app``
        (usually ``app.include_router(router)``).
    :returns: nothing.

    Called once in the main process at plugin load; the targets are called when
    ``tokenloom serve`` builds its app, after the built-in routes.
    """
