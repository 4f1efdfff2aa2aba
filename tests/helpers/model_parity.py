"""Checks a tokenloom model against its transformers twin: the same weights, a flat batch of
prompts through the paged KV cache with one prompt prefilled in chunks while the others
decode, every computed position's logits compared, and greedy tokens compared with
``generate(do_sample=False)``."""

from __future__ import annotations

import torch
from helpers.attention import PagedBatcher, allocate_kv_caches

from tokenloom.core.model_interface import ModelContext
from tokenloom.kernels.paged_attention import TorchPagedAttention


def perturb_parameters(hf_model, seed: int = 0, scale: float = 0.05):
    """Add noise to every parameter, so zero-initialised biases and norm weights carry
    information a mis-loaded tensor would lose."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in hf_model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    return hf_model


def randomize_parameters(hf_model, seed: int = 0, std: float = 2.0):
    """Fresh random weights large enough that greedy decoding is not degenerate (no token
    repeated forever) and attention depends on position: each matrix (and each stack of experts'
    matrices) ``N(0, std^2 / fan_in)``, each vector (norm weights, biases) ``1 + N(0, 0.01)``."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in hf_model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * std / param.shape[-1] ** 0.5)
            else:
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
    return hf_model


def build_model(model_class, hf_config, weights, dtype=torch.float32, model_config=None):
    model = model_class(
        ModelContext(hf_config=hf_config, dtype=dtype, device=torch.device("cpu"), model_config=model_config)
    )
    loaded = model.load_weights(weights)
    return model.eval(), loaded


def run_paged_greedy(model, prompts: list[list[int]], num_new_tokens: int, *, block_size=4, chunk_size=3, backend=None):
    """Greedy decoding of every prompt in shared steps: all prompts but the last are
    prefilled in the first step; the last arrives in ``chunk_size`` chunks alongside the
    others' decodes. Returns per prompt (generated tokens, logits of every position computed)."""
    spec = model.kv_cache_spec
    caches = allocate_kv_caches(spec.num_layers, 96, block_size, spec.num_kv_heads, spec.head_size, model.dtype)
    batcher = PagedBatcher(caches, block_size, backend or TorchPagedAttention())
    chunked = len(prompts) - 1
    pending = {index: list(prompt) for index, prompt in enumerate(prompts)}
    generated = {index: [] for index in range(len(prompts))}
    logits_seen = {index: [] for index in range(len(prompts))}
    while any(len(tokens) < num_new_tokens for tokens in generated.values()):
        step = {}
        for index in range(len(prompts)):
            if len(generated[index]) >= num_new_tokens:
                continue
            if pending[index]:
                take = chunk_size if index == chunked else len(pending[index])
                step[index], pending[index] = pending[index][:take], pending[index][take:]
            else:
                step[index] = [generated[index][-1]]
        input_ids, positions, metadata = batcher.step(step)
        with torch.no_grad():
            logits = model.compute_logits(model(input_ids, positions, metadata))
        start = 0
        for index, tokens in step.items():
            seq_logits = logits[start : start + len(tokens)]
            start += len(tokens)
            logits_seen[index].append(seq_logits)
            if not pending[index]:
                generated[index].append(int(seq_logits[-1].argmax()))
    return [(generated[index], torch.cat(logits_seen[index])) for index in range(len(prompts))]


def assert_matches_transformers(model, hf_model, prompts, num_new_tokens=6, atol=1e-4, **paged_options):
    results = run_paged_greedy(model, prompts, num_new_tokens, **paged_options)
    for prompt, (tokens, logits) in zip(prompts, results):
        with torch.no_grad():
            expected_tokens = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=num_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
            # every position our steps computed: the prompt and all generated tokens but the last
            expected_logits = hf_model(torch.tensor([prompt + tokens[:-1]])).logits[0].float()
        assert len(expected_tokens) == num_new_tokens
        torch.testing.assert_close(logits, expected_logits, atol=atol, rtol=1e-4)
        assert tokens == expected_tokens


def assert_close_to_float32(model, hf_model, prompts, num_new_tokens=4, atol=6e-2):
    """For a model running in a lower precision: every computed position's logits stay
    within ``atol`` of transformers in float32 (greedy tokens may legitimately differ)."""
    for prompt, (tokens, logits) in zip(prompts, run_paged_greedy(model, prompts, num_new_tokens)):
        assert logits.dtype == torch.float32
        with torch.no_grad():
            expected_logits = hf_model(torch.tensor([prompt + tokens[:-1]])).logits[0].float()
        torch.testing.assert_close(logits, expected_logits, atol=atol, rtol=0)


def load_checkpoint(load_format: str, hf_model, directory) -> tuple:
    """``hf_model`` saved the way ``load_format`` reads it (``safetensors``: ``save_pretrained``;
    ``gguf``: as llama.cpp's converter writes it, float32) and read back through tokenloom's load
    format: ``(config, weights)`` as the model runner would receive them."""
    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat
    from tokenloom.builtin_plugins.loaders.safetensors_format import SafetensorsLoadFormat
    from tokenloom.core.config import LoadConfig, ModelConfig

    path = saved_checkpoint(load_format, hf_model, directory)
    reader = SafetensorsLoadFormat() if load_format == "safetensors" else GGUFLoadFormat()
    config = reader.load_config(path, ModelConfig())
    return config, list(reader.iterate_weights(path, ModelConfig(), LoadConfig(use_tqdm_on_load=False)))


def saved_checkpoint(load_format: str, hf_model, directory, architecture: str | None = None) -> str:
    """``hf_model`` written where ``LLM(model=...)`` takes it: ``safetensors`` a ``save_pretrained``
    directory, ``gguf`` a float32 file as llama.cpp's converter writes it under ``architecture``
    (llama.cpp's name; by default transformers' model type, which is llama.cpp's for most)."""
    if load_format == "safetensors":
        hf_model.save_pretrained(str(directory))
        return str(directory)
    from helpers.gguf_files import write_model_gguf

    architecture = architecture or hf_model.config.model_type
    return write_model_gguf(str(directory / "model.gguf"), architecture, hf_model.config, hf_model.state_dict())


#: what a served parity test gives the offline LLM: a tiny model's context and cache, ids in and out
SERVED_OPTIONS = dict(dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**20, skip_tokenizer_init=True)


def assert_served_greedy_agrees(
    hf_model, path: str, prompts: list[list[int]], num_new_tokens: int = 10, *, distinct: bool = True, **llm_options
):
    """transformers' greedy continuation of each prompt (checked not degenerate, and with
    ``distinct`` different per prompt) against tokenloom's engine serving ``path`` through its
    scheduler, paged cache and sampler (:data:`SERVED_OPTIONS` updated with ``llm_options``):
    vLLM's model-test rule (:func:`assert_greedy_agrees`). Returns the LLM for further checks."""
    from tokenloom import LLM

    expected = [hf_greedy_top_k(hf_model, prompt, num_new_tokens) for prompt in prompts]
    if distinct:
        assert len({tuple(tokens) for tokens, _ in expected}) == len(prompts)
    assert all(len(set(tokens)) > 3 for tokens, _ in expected), "greedy decoding is degenerate"
    llm = LLM(model=path, **{**SERVED_OPTIONS, **llm_options})
    assert_greedy_agrees(served_greedy_top_k(llm, prompts, num_new_tokens), expected)
    return llm


def hf_greedy_top_k(hf_model, prompt: list[int], num_new_tokens: int, k: int = 5) -> tuple[list[int], list[set[int]]]:
    """transformers' ``generate(do_sample=False)``: the tokens and, per step, the top-``k`` ids."""
    with torch.no_grad():
        output = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=num_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = output.sequences[0, len(prompt) :].tolist()
    return tokens, [set(scores[0].topk(k).indices.tolist()) for scores in output.scores]


def served_greedy_top_k(llm, prompts: list[list[int]], num_new_tokens: int, k: int = 5):
    """Greedy decoding through tokenloom's engine: per prompt the tokens and each step's top-``k`` ids."""
    from tokenloom import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_new_tokens, ignore_eos=True, logprobs=k)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params)
    return [
        (list(output.outputs[0].token_ids), [set(step) for step in output.outputs[0].logprobs]) for output in outputs
    ]


def assert_greedy_agrees(ours, theirs, k: int = 5) -> None:
    """vLLM's model-test rule: the greedy sequences agree until the first position where they
    differ, and there each side's token is among the other's top-``k``."""
    for index, ((our_tokens, our_top), (their_tokens, their_top)) in enumerate(zip(ours, theirs, strict=True)):
        assert len(our_tokens) == len(their_tokens)
        for position, (our_token, their_token) in enumerate(zip(our_tokens, their_tokens)):
            if our_token != their_token:
                assert our_token in their_top[position] and their_token in our_top[position], (
                    f"prompt {index} diverges at step {position}: ours {our_tokens}, transformers {their_tokens}"
                )
                break
