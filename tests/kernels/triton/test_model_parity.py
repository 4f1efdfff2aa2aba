"""End to end through the engine (``LLM``): a tiny random Llama and a tiny random Gemma 3
(sliding-window and global layers, query/key norms, GQA) give the same greedy token ids with
``attention_backend="triton"`` -- the Triton kernels, run by Triton's interpreter on the CPU --
as with the torch backend. A small token budget mixes chunked prefills with decodes in the
same steps, and a shared prefix makes prefix-cache hits prefill over a cached prefix."""

from __future__ import annotations

import pytest
import torch
from helpers.model_parity import perturb_parameters

pytest.importorskip("triton", reason="the Triton kernels need the triton package (the `gpu` extra)")

from tokenloom import LLM, SamplingParams  # noqa: E402
from tokenloom.kernels.triton.attention import TritonPagedAttention  # noqa: E402

SHARED = "You are a helpful assistant. Answer briefly and exactly. "
PROMPTS = [
    SHARED + "The capital of France is",
    "def fibonacci(n):",
    SHARED + "1, 2, 3, 4,",
    "Once upon a time, in a land far away, there lived a",
]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory, smollm2_gguf):
    """A tiny random Gemma 3 text model (window of 8 tokens, shorter than the prompts; head size
    32) saved as safetensors with SmolLM2's tokenizer."""
    from helpers.tiny_gemma3 import tiny_gemma3_config
    from transformers import Gemma3ForCausalLM

    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat

    directory = tmp_path_factory.mktemp("tiny-gemma3")
    tokenizer = GGUFLoadFormat().load_tokenizer(smollm2_gguf, None)
    tokenizer.save_pretrained(directory)
    config = tiny_gemma3_config(tokenizer)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    perturb_parameters(model)  # zero-initialised norm weights would hide a mis-applied norm
    model.save_pretrained(directory, safe_serialization=True)
    return str(directory)


def greedy_ids(model_dir, attention_backend):
    llm = LLM(
        model=model_dir,
        dtype="float32",
        attention_backend=attention_backend,
        max_num_batched_tokens=24,  # prompts are prefilled in chunks beside other requests' decodes
        block_size=16,
        enable_prefix_caching=True,
    )
    try:
        backend = llm.engine.executor.worker.runner.attention_backend
        assert isinstance(backend, TritonPagedAttention) == (attention_backend == "triton")
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        llm.generate(PROMPTS[:1], params)  # the shared prefix is cached before the batch arrives
        return [output.outputs[0].token_ids for output in llm.generate(PROMPTS, params)]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("model", ["llama", "gemma3"])
def test_triton_backend_gives_the_torch_backends_greedy_ids(model, request):
    model_dir = request.getfixturevalue("tiny_llama_dir" if model == "llama" else "tiny_gemma3_dir")
    expected = greedy_ids(model_dir, "torch")
    actual = greedy_ids(model_dir, "triton")
    assert all(len(ids) == MAX_TOKENS for ids in expected)
    assert actual == expected
