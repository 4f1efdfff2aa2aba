"""``ModelConfig``: which model runs and how (dtype, context length, runner, implementation,
logprobs, generation defaults, logits processors)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DTYPE_CHOICES = ("auto", "half", "float16", "bfloat16", "float", "float32")
# --model-impl: vLLM's names (its ``terratorch`` is refused), plus ``native`` for ``vllm``
MODEL_IMPL_CHOICES = ("auto", "vllm", "native", "transformers")


@dataclass
class ModelConfig:
    model: str = "smollm2"
    """Name or path of the model: a local directory, a .gguf file, a Hugging Face repo id, or
    the short name of a model shipped in a pip package (``smollm2``, ``gemma3-270m``,
    ``all-minilm-l6-v2``)."""
    tokenizer: str | None = None
    """Name or path of the tokenizer; defaults to the model's."""
    tokenizer_mode: str = "auto"
    """``auto`` uses the fast tokenizer when there is one, ``slow`` forces the slow one
    (``mistral`` and ``custom`` are refused: tokenloom reads Hugging Face and GGUF
    tokenizers only)."""
    revision: str | None = None
    """The model revision (branch, tag or commit) on the Hugging Face Hub."""
    tokenizer_revision: str | None = None
    """The tokenizer revision on the Hugging Face Hub."""
    dtype: str = "auto"
    """Data type of weights and activations: auto, half/float16, bfloat16, float/float32.
    ``auto`` takes the platform's default for the model's dtype."""
    max_model_len: int | None = None
    """Model context length (prompt plus output); defaults to the model's own."""
    served_model_name: list[str] | None = None
    """The model name(s) the API answers to; the first is reported. Defaults to ``--model``."""
    seed: int | None = 0
    """Random seed for weight initialisation (dummy weights) and unseeded sampling: two engines
    started with the same seed sample the same tokens for the same sequence of requests."""
    hf_overrides: dict[str, Any] | None = None
    """JSON dict of values to override in the model's Hugging Face config."""
    rope_scaling: dict[str, Any] | None = None
    """JSON dict of RoPE scaling settings, e.g. ``{"rope_type": "linear", "factor": 2.0}``."""
    rope_theta: float | None = None
    """RoPE theta; overrides the model's."""
    trust_remote_code: bool = False
    """Accepted for compatibility; tokenloom never runs model code from the model's files."""
    max_logprobs: int = 20
    """Maximum number of log probabilities to return per token (logprobs, prompt_logprobs);
    -1: no cap (up to the whole vocabulary)."""
    logprobs_mode: str = "raw_logprobs"
    """What logprobs hold: raw_logprobs, processed_logprobs, raw_logits, processed_logits."""
    skip_tokenizer_init: bool = False
    """Run without a tokenizer: prompts must be token ids (/v1/completions), outputs are token
    ids (``return_token_ids``) with empty text; text prompts, chat and /tokenize get a 400."""
    generation_config: str = "auto"
    """Where request defaults come from: ``auto`` reads the model's generation_config.json
    (or a GGUF's general.sampling.* keys), ``vllm`` ignores them, a folder path reads its
    generation_config.json. They set temperature, top_p, top_k, min_p and repetition_penalty
    for requests that leave them unset, and max_new_tokens caps every request's max_tokens."""
    override_generation_config: dict[str, Any] | None = None
    """JSON dict of generation defaults applied over --generation-config's, by their
    generation_config.json names, e.g. ``{"temperature": 0.5, "max_new_tokens": 256}``."""
    enforce_eager: bool = False
    """Accepted for compatibility: tokenloom always runs the model eagerly (no torch.compile,
    no CUDA graphs)."""
    task: str = "auto"
    """Deprecated vLLM name for the runner: auto, generate, embed, score, classify, reward."""
    runner: str = "auto"
    """auto, generate or pooling."""
    convert: str = "auto"
    """Adapt a model to another task: auto, none, embed, classify, reward."""
    override_pooler_config: dict[str, Any] | None = None
    """JSON dict overriding the pooler (pooling_type, normalize, softmax)."""
    disable_sliding_window: bool = False
    """Disable sliding-window attention, capping the context at the window."""
    model_impl: str = "auto"
    """Which implementation runs the model: ``auto`` takes tokenloom's native model plugin for
    the architecture and, where none is registered, transformers' own modeling code with
    tokenloom's paged attention (the Transformers fallback: decoder-only causal LMs whose
    attention goes through transformers' attention interface; one worker, no LoRA); ``vllm``
    (or ``native``) only a native plugin; ``transformers`` the fallback even where a native
    plugin exists. ``terratorch`` is refused."""
    mmproj: str | None = None
    """A GGUF model's vision projector file (llama.cpp's ``mmproj``, as ``llama-server
    --mmproj``; ``convert_hf_to_gguf.py --mmproj`` writes it): the model then takes images.
    Served: SmolVLM's (``idefics3``) beside its llama language model."""
    quantization: str | None = None
    """Quantization method of the weights; default is what the model's files need."""
    logits_processors: list[str] | None = None
    """Logits processors applied to every request, built with no arguments: registered names
    (the register_logits_processors hook) or import paths (``pkg.mod.Class`` or
    ``pkg.mod:Class``) of a class, factory or function
    ``fn(prompt_token_ids, output_token_ids, logits) -> logits``."""
    logits_processor_pattern: str | None = None
    """Regex of qualified names (``pkg.mod.Class``) that a request's ``logits_processors`` may
    import and run; the whole name must match (``my_pkg\\.processors\\..*``), and it must name a
    class or function defined in that module. Unset, requests may name only registered
    processors."""
