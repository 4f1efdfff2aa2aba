import pytest

# `isa_level`: a module that uses it runs once per CPU kernel level the host runs (test_lora_kernels)
from helpers.isa_levels import isa_level  # noqa: F401

from tokenloom import LoRARequest


@pytest.fixture(scope="module")
def lora_requests(adapter_dirs):
    """A request per adapter of the module's ``adapter_dirs`` (name -> path), with ids 1, 2, ..."""
    return {name: LoRARequest(name, index + 1, path) for index, (name, path) in enumerate(adapter_dirs.items())}


@pytest.fixture(scope="module")
def prompt_ids(request, tiny_llama_dir):
    """The module's ``PROMPTS`` in the tiny Llama's token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    return [tokenizer(prompt).input_ids for prompt in request.module.PROMPTS]
