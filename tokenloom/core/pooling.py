"""Pooling models, main-process side: which runner a model gets (``--runner``, ``--task``,
``--convert``, or how its plugin registered it), its pooler settings (the model's
sentence-transformers files, then ``--pooler-config``), and the validation of a pooling
prompt and its :class:`~tokenloom.core.sampling_params.PoolingParams`. Plain data and JSON only:
the pooling itself runs in the worker (``tokenloom.layers.pooler``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from typing import Any

from tokenloom.core.sampling_params import PoolingParams, unwrap_prompt
from tokenloom.errors import ConfigError, ContextLengthError, InvalidRequestError, ModelLoadError

logger = logging.getLogger(__name__)

GENERATE = "generate"
POOLING = "pooling"
POOLING_TYPES = ("CLS", "MEAN", "LAST")
# --task values (vLLM's names) -> the runner they need; None: not supported here
_TASK_RUNNERS: dict[str, str | None] = {
    "auto": None,
    "generate": GENERATE,
    "embed": POOLING,
    "embedding": POOLING,
    "score": POOLING,
}
# sentence-transformers Pooling flags -> our pooling types
_SENTENCE_TRANSFORMERS_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}
_SENTENCE_TRANSFORMERS_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass
class PoolerConfig:
    """How a pooling model turns hidden states into one vector; ``None`` takes the model's
    default (its plugin's pooling type; normalize on, softmax off)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    softmax: bool | None = None

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, source: str = "--pooler-config") -> PoolerConfig:
        """Validated settings from JSON; unknown keys and bad values name the flag."""
        if not isinstance(values, dict):
            raise ConfigError(f"{source} must be a JSON object, got {values!r}", param="pooler_config")
        known = ("pooling_type", "normalize", "softmax")
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(
                f"{source}: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}", param="pooler_config"
            )
        pooling_type = values.get("pooling_type")
        if pooling_type is not None:
            if not isinstance(pooling_type, str) or pooling_type.upper() not in POOLING_TYPES:
                raise ConfigError(
                    f"{source}: pooling_type must be one of {', '.join(POOLING_TYPES)}, got {pooling_type!r}",
                    param="pooler_config",
                )
            pooling_type = pooling_type.upper()
        for key in ("normalize", "softmax"):
            if values.get(key) is not None and not isinstance(values[key], bool):
                raise ConfigError(f"{source}: {key} must be true or false, got {values[key]!r}", param="pooler_config")
        return cls(pooling_type=pooling_type, normalize=values.get("normalize"), softmax=values.get("softmax"))

    def merged(self, override: PoolerConfig) -> PoolerConfig:
        """These settings with every field ``override`` sets replaced."""
        return PoolerConfig(
            **{key: value if value is not None else getattr(self, key) for key, value in asdict(override).items()}
        )


# -- the runner --------------------------------------------------------------------------


def resolve_runner(model_config: Any, architecture: str, registered_runner: str) -> str:
    """``generate`` or ``pooling`` for this model and these flags.

    :param registered_runner: what the model plugin registered (``runner="pooling"`` for an
        encoder like ``BertModel``; ``generate`` otherwise).
    """
    task = getattr(model_config, "task", "auto") or "auto"
    runner = getattr(model_config, "runner", "auto") or "auto"
    convert = getattr(model_config, "convert", "auto") or "auto"
    if task not in _TASK_RUNNERS:
        raise ConfigError(
            f"--task {task} is not supported: tokenloom serves generate, embed and score "
            "(embedding similarity); a classifier or reward head is not implemented",
            param="task",
        )
    if convert not in ("auto", "none", "embed"):
        raise ConfigError(
            f"--convert {convert} is not supported: only --convert embed (a pooling runner "
            "over the model's hidden states) is implemented",
            param="convert",
        )
    if runner not in ("auto", GENERATE, POOLING):
        raise ConfigError(f"--runner {runner} is not supported; use generate or pooling", param="runner")
    wanted = {runner} - {"auto"}
    if _TASK_RUNNERS[task]:
        wanted.add(_TASK_RUNNERS[task])
    if convert == "embed":
        wanted.add(POOLING)
    if len(wanted) > 1:
        raise ConfigError(
            f"--runner {runner}, --task {task} and --convert {convert} contradict each other: "
            "pooling (embed, score) and generation need different runners",
            param="runner",
        )
    chosen = wanted.pop() if wanted else registered_runner
    if chosen == GENERATE and registered_runner == POOLING:
        raise ConfigError(
            f"{architecture} is a pooling model (embeddings, scores): it cannot generate text; "
            "drop --runner generate / --task generate",
            param="runner",
        )
    if chosen == POOLING and registered_runner != POOLING and convert == "none":
        raise ConfigError(
            f"{architecture} is a generative model: --runner pooling needs --convert embed "
            "(or auto), not --convert none",
            param="convert",
        )
    return chosen


# -- the pooler settings -------------------------------------------------------------------


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc


def sentence_transformers_pooler(model_dir: str) -> PoolerConfig | None:
    """The pooler a sentence-transformers model declares (``modules.json``, its Pooling
    module's ``config.json``, a Normalize module), or None when the files are absent."""
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    modules = _read_json(modules_path)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{modules_path} is not a list of modules")
    pooling_type = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).rpartition(".")[2]
        if kind not in _SENTENCE_TRANSFORMERS_MODULES:
            raise ModelLoadError(
                f"{modules_path} uses the sentence-transformers module {kind!r}, which tokenloom "
                f"does not implement (only {', '.join(_SENTENCE_TRANSFORMERS_MODULES)})"
            )
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            config_path = os.path.join(model_dir, module.get("path", ""), "config.json")
            pooling_type = _pooling_type_of(_read_json(config_path), config_path)
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize)


def _pooling_type_of(pooling: dict[str, Any], config_path: str) -> str:
    enabled = [key for key, value in pooling.items() if key.startswith("pooling_mode_") and value is True]
    unsupported = [key for key in enabled if key not in _SENTENCE_TRANSFORMERS_MODES]
    if unsupported or len(enabled) != 1:
        raise ModelLoadError(
            f"{config_path} enables {', '.join(enabled) or 'no pooling mode'}; tokenloom pools with "
            "exactly one of cls_token, mean_tokens or lasttoken (override with --pooler-config "
            '\'{"pooling_type": "MEAN"}\')'
        )
    return _SENTENCE_TRANSFORMERS_MODES[enabled[0]]


def model_directory(model_path: str) -> str:
    """The directory of a model's files: ``model_path`` itself, or a single file's directory."""
    return model_path if os.path.isdir(model_path) else os.path.dirname(os.path.abspath(model_path))


def sentence_transformers_max_seq_length(model_path: str) -> int | None:
    """``max_seq_length`` of ``sentence_bert_config.json``: the input length the model was
    trained for (sentence-transformers truncates there)."""
    path = os.path.join(model_directory(model_path), "sentence_bert_config.json")
    if not os.path.isfile(path):
        return None
    value = _read_json(path).get("max_seq_length")
    return value if isinstance(value, int) and value > 0 else None


def resolve_pooler_config(model_path: str, model_config: Any) -> PoolerConfig:
    """The model's sentence-transformers pooler, with ``--pooler-config`` on top."""
    config = sentence_transformers_pooler(model_directory(model_path)) or PoolerConfig()
    override = getattr(model_config, "override_pooler_config", None)
    if override:
        config = config.merged(PoolerConfig.from_dict(override))
    logger.info("pooler: %s", config)
    return config


# -- requests ----------------------------------------------------------------------------------


def check_pooling_params(params: PoolingParams, hf_config: Any) -> None:
    """``dimensions`` only for Matryoshka models (``matryoshka_dimensions`` or
    ``is_matryoshka`` in the model config), or equal to the full size."""
    if params.dimensions is None:
        return
    hidden_size = getattr(hf_config, "hidden_size", None)
    if hidden_size is not None and params.dimensions > hidden_size:
        raise InvalidRequestError(
            f"dimensions {params.dimensions} is more than the model's {hidden_size}", param="dimensions"
        )
    if params.dimensions == hidden_size:
        return
    allowed = getattr(hf_config, "matryoshka_dimensions", None)
    if allowed:
        if params.dimensions not in allowed:
            raise InvalidRequestError(
                f"dimensions must be one of {sorted(allowed)} for this model, got {params.dimensions}",
                param="dimensions",
            )
        return
    if not getattr(hf_config, "is_matryoshka", False):
        raise InvalidRequestError(
            f"this model was not trained for shorter embeddings (not a Matryoshka model): drop dimensions or set it "
            f"to {hidden_size}",
            param="dimensions",
        )


def prepare_pooling_prompt(
    prompt: Any, params: PoolingParams, tokenizer: Any, vocab_size: int, max_model_len: int
) -> tuple[list[int], str | None]:
    """``(token_ids, text)`` of a pooling prompt (text, token ids, or vLLM's dict forms),
    truncated as ``params`` asks and checked against the context length (a pooling prompt
    may fill it: nothing is generated after it)."""
    prompt = unwrap_prompt(prompt, "input")
    truncate = params.truncate_prompt_tokens
    text = None
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError(
                "the tokenizer was skipped (--skip-tokenizer-init): send token ids", param="input"
            )
        text = prompt
        if truncate is not None:
            token_ids = tokenizer(prompt, add_special_tokens=True, truncation=True, max_length=truncate)["input_ids"]
        else:
            token_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        token_ids = list(token_ids)
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        token_ids = list(prompt)
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is out of the vocabulary [0, {vocab_size})", param="input")
        if truncate is not None:
            token_ids = token_ids[-truncate:]
    else:
        raise InvalidRequestError("an input must be a string or a list of token ids", param="input")
    if not token_ids:
        raise InvalidRequestError("an input is empty (it has no tokens)", param="input")
    if len(token_ids) > max_model_len:
        raise ContextLengthError(
            f"an input has {len(token_ids)} tokens, but this model takes at most {max_model_len}: shorten it or set "
            "truncate_prompt_tokens",
            param="input",
        )
    return token_ids, text


# -- scoring by embedding similarity ---------------------------------------------------------


def score_inputs(
    text_1: Any, text_2: Any, *, param_1: str = "text_1", param_2: str = "text_2"
) -> tuple[list[Any], list[Any], list[tuple[int, int]]]:
    """``(first inputs, second inputs, pairs)`` to score, paired as vLLM pairs them: one
    ``text_1`` against every ``text_2``, or two lists of the same length item by item. An
    input is a string or a list of token ids."""
    first = [text_1] if isinstance(text_1, (str, dict)) or _is_token_ids(text_1) else list(text_1)
    second = [text_2] if isinstance(text_2, (str, dict)) or _is_token_ids(text_2) else list(text_2)
    if not first:
        raise InvalidRequestError(f"{param_1} is empty: give at least one input", param=param_1)
    if not second:
        raise InvalidRequestError(f"{param_2} is empty: give at least one input", param=param_2)
    if len(first) == 1:
        return first, second, [(0, index) for index in range(len(second))]
    if len(first) != len(second):
        raise InvalidRequestError(
            f"{param_1} has {len(first)} inputs and {param_2} {len(second)}: give one {param_1} "
            f"or as many as {param_2}",
            param=param_1,
        )
    return first, second, [(index, index) for index in range(len(first))]


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def cosine_similarity(first: Any, second: Any) -> float:
    """Cosine similarity of two pooled vectors (CPU tensors)."""
    import torch

    first, second = first.float(), second.float()
    denominator = torch.linalg.vector_norm(first) * torch.linalg.vector_norm(second)
    return float(torch.dot(first, second) / denominator.clamp_min(1e-12))
