"""LoRA adapters in PEFT's format (``adapter_config.json`` with ``adapter_model.safetensors``
or ``adapter_model.bin``): read, checked against the base model and ``--max-lora-rank``, and
turned into ``(A, B)`` pairs per projection, keyed by a canonical module name
(``layers.3.self_attn.q_proj``, ``embed_tokens``, ``lm_head``) that is the same for every
Llama-family checkpoint layout. An adapter that adds tokens (a resized vocabulary, whole
embeddings in ``modules_to_save``) is refused: there is no per-adapter vocabulary.

Everything refused here is refused by name (the key, the option, the module), so a user
knows what to change. The checks run in the engine's process when an adapter is first used
(an :class:`LoRAAdapterError` is a 400) and again in the worker against the real layers.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from tokenloom.errors import InvalidRequestError

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")

# the projections of a Llama/Qwen2/Gemma 3 decoder layer an adapter may target, by block
SUPPORTED_PROJECTIONS: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# the token embedding (PEFT's embedding LoRA) and the LM head (a linear target), by canonical name
EMBEDDING_MODULES = ("embed_tokens", "lm_head")
# other families' names for them, which no model tokenloom adapts has
UNSUPPORTED_MODULES = ("wte", "embed_out")

_LORA_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.([A-Za-z0-9_]+)\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight$"
)
# embed_tokens.lora_embedding_A, lm_head.lora_A.weight; and the base weights PEFT saves beside
# them (save_embedding_layers), which are the base model's unless the vocabulary was resized
_EMBEDDING_KEY = re.compile(
    r"(?:^|\.)(embed_tokens|lm_head)\.(?:lora_embedding_([AB])|lora_([AB])\.weight|(base_layer)\.weight)$"
)
_NO_EXTRA_VOCAB = (
    "tokenloom serves no per-adapter vocabulary (vLLM dropped its extra-vocab support too): serve the "
    "adapter with a base model that has these tokens, or train it without adding tokens"
)


class LoRAAdapterError(InvalidRequestError):
    """An adapter that cannot be served with this model and these settings (400)."""


class UnusableAdapterPathError(LoRAAdapterError):
    """The path leads to no adapter files that can be read; the catalog answers every such path
    with one message (what exists on the server is not a client's business)."""


@dataclass
class PeftAdapter:
    """One adapter's weights, ready for the worker's slots.

    ``weights[name] = (lora_a [rank, in], lora_b [out, rank])`` in float32, with the adapter's
    scaling (``alpha / rank``, or rsLoRA's ``alpha / sqrt(rank)``) already multiplied into B.
    """

    path: str
    rank: int
    scaling: float
    base_model_name: str | None
    weights: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    @property
    def target_modules(self) -> list[str]:
        """The kinds of projection the adapter changes (``q_proj``, ``down_proj``...)."""
        return sorted({name.rsplit(".", 1)[-1] for name in self.weights})

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def canonical_name(layer_index: int, block: str, projection: str) -> str:
    return f"layers.{layer_index}.{block}.{projection}"


def find_adapter_files(path: str) -> tuple[str, str]:
    """``(config file, weight file)`` of the adapter folder at ``path``."""
    if not os.path.isdir(path):
        raise UnusableAdapterPathError(
            f"LoRA adapter path {path} is not a directory holding {CONFIG_FILE}", param="lora_path"
        )
    config_file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_file):
        raise UnusableAdapterPathError(f"LoRA adapter folder {path} has no {CONFIG_FILE}", param="lora_path")
    for weight_name in WEIGHT_FILES:
        weight_file = os.path.join(path, weight_name)
        if os.path.isfile(weight_file):
            return config_file, weight_file
    raise UnusableAdapterPathError(
        f"LoRA adapter folder {path} has neither {' nor '.join(WEIGHT_FILES)}", param="lora_path"
    )


def read_adapter_config(config_file: str) -> dict[str, Any]:
    try:
        with open(config_file, encoding="utf-8") as handle:
            config = json.load(handle)
    except OSError as exc:  # unreadable (permissions): as if it were not there
        raise UnusableAdapterPathError(f"cannot read {config_file}: {exc}", param="lora_path") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LoRAAdapterError(f"{CONFIG_FILE} of the adapter is not valid JSON: {exc}", param="lora_path") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{config_file} does not hold a JSON object", param="lora_path")
    return config


def check_adapter_config(config: dict[str, Any], max_lora_rank: int, where: str) -> tuple[int, float]:
    """The adapter's ``(rank, scaling)``; raises for what tokenloom does not serve."""
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAAdapterError(f"{where} is a {peft_type} adapter; only LORA adapters are served", param="lora_path")
    if config.get("use_dora"):
        raise LoRAAdapterError(f"{where} is a DoRA adapter (use_dora: true), which tokenloom does not serve")
    if config.get("bias", "none") not in ("none", None):
        raise LoRAAdapterError(
            f"{where} trains biases (bias: {config['bias']!r}); only bias 'none' adapters are served "
            "(--enable-lora-bias is not implemented)"
        )
    for option in ("rank_pattern", "alpha_pattern"):
        if config.get(option):
            raise LoRAAdapterError(f"{where} sets {option}; per-module ranks and alphas are not supported yet")
    modules_to_save = [name for name in (config.get("modules_to_save") or []) if name]
    saved_embeddings = [name for name in modules_to_save if name in EMBEDDING_MODULES + UNSUPPORTED_MODULES]
    if saved_embeddings:
        raise LoRAAdapterError(
            f"{where} saves whole {', '.join(saved_embeddings)} (modules_to_save), as an adapter that resizes "
            f"the vocabulary or retrains token embeddings does; {_NO_EXTRA_VOCAB}"
        )
    if modules_to_save:
        raise LoRAAdapterError(
            f"{where} saves whole modules ({', '.join(modules_to_save)}: modules_to_save), which tokenloom does not serve"
        )
    if config.get("trainable_token_indices"):
        raise LoRAAdapterError(
            f"{where} retrains the embeddings of some tokens (trainable_token_indices); {_NO_EXTRA_VOCAB}"
        )
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    unsupported = [name for name in targets if name in UNSUPPORTED_MODULES]
    if unsupported:
        raise LoRAAdapterError(
            f"{where} targets {', '.join(unsupported)}; tokenloom applies LoRA to the attention and MLP "
            f"projections ({', '.join(SUPPORTED_PROJECTIONS)}), embed_tokens and lm_head"
        )
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"{where} has no valid rank r ({rank!r})")
    if rank > max_lora_rank:
        raise LoRAAdapterError(
            f"{where} has rank {rank}, more than --max-lora-rank {max_lora_rank}: restart with a larger --max-lora-rank",
            param="max_lora_rank",
        )
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoRAAdapterError(f"{where} has no valid lora_alpha ({alpha!r})")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _load_tensors(weight_file: str) -> dict[str, Any]:
    import torch

    try:
        if weight_file.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(weight_file, device="cpu")
        tensors = torch.load(weight_file, map_location="cpu", weights_only=True)
    except OSError as exc:  # unreadable (permissions): as if it were not there
        raise UnusableAdapterPathError(f"cannot read LoRA weights {weight_file}: {exc}", param="lora_path") from None
    except Exception as exc:  # a truncated or foreign file: say which
        raise LoRAAdapterError(f"cannot read LoRA weights {weight_file}: {type(exc).__name__}: {exc}") from None
    if not isinstance(tensors, dict) or not all(
        isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in tensors.items()
    ):
        raise LoRAAdapterError(f"LoRA weights {weight_file} are not a mapping of names to tensors")
    return tensors


def load_peft_adapter(
    path: str,
    *,
    max_lora_rank: int,
    module_shapes: dict[str, tuple[int, int]],
    base_model_description: str = "this model",
    dtype: Any = None,
) -> PeftAdapter:
    """Read the adapter at ``path`` and check every tensor against ``module_shapes``
    (canonical name -> ``(input features, output features)`` of the base projection).

    :param dtype: the LoRA weights' dtype in the slots (``--lora-dtype``), when known: every
        weight must be finite there too (a float32 weight beyond float16's range is inf in it).
    """
    import torch

    config_file, weight_file = find_adapter_files(path)
    config = read_adapter_config(config_file)
    where = f"LoRA adapter {path}"
    rank, scaling = check_adapter_config(config, max_lora_rank, where)
    base_model_name = config.get("base_model_name_or_path")
    pairs: dict[str, dict[str, Any]] = {}
    saved_base_rows: dict[str, int] = {}  # key -> rows of a base embedding/LM head PEFT saved
    for key, tensor in _load_tensors(weight_file).items():
        embedding_match = _EMBEDDING_KEY.search(key)
        if embedding_match is not None:
            module, embedding_side, linear_side, base_layer = embedding_match.groups()
            if base_layer:
                saved_base_rows[f"{module}.base_layer.weight"] = tensor.shape[0] if tensor.dim() == 2 else -1
                continue
            if (module == "embed_tokens") != (embedding_side is not None):
                raise LoRAAdapterError(
                    f"{where} holds {key}: tokenloom reads embed_tokens as PEFT's embedding LoRA "
                    "(lora_embedding_A/B) and lm_head as a linear one (lora_A/B)"
                )
            pairs.setdefault(module, {})[embedding_side or linear_side] = tensor
            continue
        embedding_names = EMBEDDING_MODULES + UNSUPPORTED_MODULES
        if any(f".{name}." in f".{key}" for name in embedding_names) or "lora_embedding" in key:
            raise LoRAAdapterError(
                f"{where} has weights for an embedding or LM head that are not a LoRA of embed_tokens or "
                f"lm_head ({key}): whole or resized embeddings are not served; {_NO_EXTRA_VOCAB}"
            )
        match = _LORA_KEY.search(key)
        if match is None:
            raise LoRAAdapterError(f"{where} holds a tensor tokenloom does not know how to apply: {key}")
        layer_index, block, projection, side = int(match[1]), match[2], match[3], match[4]
        if SUPPORTED_PROJECTIONS.get(projection) != block:
            raise LoRAAdapterError(
                f"{where} targets {block}.{projection}; supported targets are "
                f"{', '.join(f'{b}.{p}' for p, b in SUPPORTED_PROJECTIONS.items())}"
            )
        pairs.setdefault(canonical_name(layer_index, block, projection), {})[side] = tensor
    if not pairs:
        raise LoRAAdapterError(f"{where} holds no LoRA weights")
    _check_vocabulary(where, pairs, saved_base_rows, module_shapes)
    adapter = PeftAdapter(path=path, rank=rank, scaling=scaling, base_model_name=base_model_name)
    mismatch_hint = f" (the adapter's base model is {base_model_name})" if base_model_name else ""
    for name, sides in sorted(pairs.items()):
        if set(sides) != {"A", "B"}:
            missing = "lora_B" if "A" in sides else "lora_A"
            raise LoRAAdapterError(f"{where} has no {missing} weight for {name}")
        if name not in module_shapes:
            raise LoRAAdapterError(
                f"{where} targets {name}, which {base_model_description} does not have{mismatch_hint}: "
                "was it trained for another base model?"
            )
        lora_a, lora_b = sides["A"].to(torch.float32), sides["B"].to(torch.float32)
        in_features, out_features = module_shapes[name]
        if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_b.shape[1] != lora_a.shape[0]:
            raise LoRAAdapterError(
                f"{where}: {name}'s lora_A {tuple(lora_a.shape)} and lora_B {tuple(lora_b.shape)} do not pair up: "
                "each must be a matrix, lora_A [rank, in] and lora_B [out, rank]"
            )
        module_rank = lora_a.shape[0]
        if module_rank > max_lora_rank:
            raise LoRAAdapterError(
                f"{where}: {name} has rank {module_rank}, more than --max-lora-rank {max_lora_rank}",
                param="max_lora_rank",
            )
        if module_rank != rank:
            raise LoRAAdapterError(f"{where}: {name} has rank {module_rank} but the adapter's r is {rank}")
        if lora_a.shape[1] != in_features or lora_b.shape[0] != out_features:
            raise LoRAAdapterError(
                f"{where}: {name} maps {lora_a.shape[1]} -> {lora_b.shape[0]} features, but "
                f"{base_model_description}'s {name} maps {in_features} -> {out_features}{mismatch_hint}: "
                "the adapter was trained for another base model"
            )
        scaled_b = lora_b * scaling
        _check_finite(where, name, "lora_A", lora_a, dtype)
        _check_finite(
            where, name, "lora_B" if scaling == 1 else f"lora_B times the scaling {scaling:g}", scaled_b, dtype
        )
        adapter.weights[name] = (lora_a.contiguous(), scaled_b.contiguous())
    return adapter


def _check_finite(where: str, name: str, what: str, weight: Any, dtype: Any) -> None:
    """Refuse a weight that is nan or inf, in float32 or in the slots' ``dtype``.

    Such a weight can only give its own requests nan (the layers never mix a slot's values
    into another's rows), but an adapter that cannot produce a number is broken: say so at
    load rather than serve empty text. Finite weights whose products overflow are not refused
    (no bound on them is principled short of running the model): they too stay in their rows.
    """
    import torch

    if bool(torch.isfinite(weight).all()) and (dtype is None or bool(torch.isfinite(weight.to(dtype)).all())):
        return
    if not bool(torch.isfinite(weight).all()):
        problem = "holds nan or inf values"
    else:
        limit = torch.finfo(dtype).max
        problem = f"holds values beyond {str(dtype).removeprefix('torch.')}'s range (±{limit:.4g}, the LoRA dtype)"
    raise LoRAAdapterError(f"{where}: {name}'s {what} {problem}; the adapter cannot be served", param="lora_path")


def _check_vocabulary(
    where: str,
    pairs: dict[str, dict[str, Any]],
    saved_base_rows: dict[str, int],
    module_shapes: dict[str, tuple[int, int]],
) -> None:
    """Refuse, saying why, an adapter trained over a resized vocabulary: its saved base
    embedding, its ``lora_embedding_A`` or its LM head's ``lora_B`` has more rows than the
    model has tokens."""
    vocab_size = module_shapes.get("embed_tokens", (None, None))[0]
    if vocab_size is None:
        return
    rows = dict(saved_base_rows)
    if "A" in pairs.get("embed_tokens", {}) and pairs["embed_tokens"]["A"].dim() == 2:
        rows["embed_tokens.lora_embedding_A"] = pairs["embed_tokens"]["A"].shape[1]
    if "B" in pairs.get("lm_head", {}) and pairs["lm_head"]["B"].dim() == 2:
        rows["lm_head.lora_B"] = pairs["lm_head"]["B"].shape[0]
    for name, num_tokens in sorted(rows.items()):
        if num_tokens > vocab_size:
            raise LoRAAdapterError(
                f"{where} was trained over {num_tokens} tokens ({name}), {num_tokens - vocab_size} more than the "
                f"model's vocabulary of {vocab_size}: it adds tokens; {_NO_EXTRA_VOCAB}"
            )


def module_shapes_from_config(hf_config: Any) -> dict[str, tuple[int, int]]:
    """Canonical name -> ``(in, out)`` of every adaptable projection of a Llama-family
    decoder, from its Hugging Face config (the engine's process has no model to ask)."""
    config = getattr(hf_config, "text_config", None) or hf_config
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_size = getattr(config, "head_dim", None) or hidden // heads
    intermediate = config.intermediate_size
    per_layer = {
        "self_attn.q_proj": (hidden, heads * head_size),
        "self_attn.k_proj": (hidden, kv_heads * head_size),
        "self_attn.v_proj": (hidden, kv_heads * head_size),
        "self_attn.o_proj": (heads * head_size, hidden),
        "mlp.gate_proj": (hidden, intermediate),
        "mlp.up_proj": (hidden, intermediate),
        "mlp.down_proj": (intermediate, hidden),
    }
    shapes = {
        f"layers.{index}.{suffix}": shape
        for index in range(config.num_hidden_layers)
        for suffix, shape in per_layer.items()
    }
    # (in, out) as for a projection: the embedding maps a one-hot token to a hidden state
    shapes["embed_tokens"] = (config.vocab_size, hidden)
    shapes["lm_head"] = (hidden, config.vocab_size)
    return shapes
