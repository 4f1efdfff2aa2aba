"""SmolVLM as llama.cpp ships it: a tiny random Idefics3 checkpoint converted by llama.cpp's own
``convert_hf_to_gguf.py`` into the language model's GGUF and the ``--mmproj`` projector GGUF,
served with ``mmproj=`` (``--mmproj``): the same config, the same expanded prompt for a split
image and the same tokens and logprobs as the safetensors checkpoint; and the refusals of a
projector file tokenloom cannot use, offline and as `tokenloom serve --mmproj` meets them."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.idefics3_checkpoint import convert_with_llama_cpp, llama_cpp_converter, write_tiny_idefics3
from helpers.llava_checkpoint import drawn_image

from tokenloom import LLM, SamplingParams
from tokenloom.builtin_plugins.models.idefics3_processing import Idefics3Processor
from tokenloom.core.multimodal.processor import ProcessorContext
from tokenloom.errors import ConfigError

needs_converter = pytest.mark.skipif(
    llama_cpp_converter() is None, reason="llama.cpp's convert_hf_to_gguf.py is not here"
)

ENGINE = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=96, block_size=4)
QUESTION = "User:<image>What is in the picture?<end_of_utterance>\nAssistant:"


@pytest.fixture(scope="module")
def files(tmp_path_factory, smollm2_gguf):
    checkpoint = tmp_path_factory.mktemp("tiny-smolvlm")
    write_tiny_idefics3(checkpoint, smollm2_gguf)
    text, mmproj = convert_with_llama_cpp(str(checkpoint), tmp_path_factory.mktemp("gguf"))
    return str(checkpoint), text, mmproj


def greedy_with_image(llm, image) -> tuple[list[int], list[int], list[float]]:
    """(the expanded prompt, the greedy tokens, their logprobs) for ``QUESTION`` with ``image``."""
    hf_config = llm.engine.model_info.hf_config
    processor = Idefics3Processor(ProcessorContext(hf_config, hf_config.name_or_path, llm.get_tokenizer(), {}))
    processed = processor.process(llm.get_tokenizer().encode(QUESTION), [image], {})
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    prompt = {"prompt_token_ids": processed.prompt_token_ids, "mm_items": processed.items}
    completion = llm.generate([prompt], params)[0].outputs[0]
    logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids, strict=True)]
    return processed.prompt_token_ids, list(completion.token_ids), logprobs


@needs_converter
def test_gguf_with_its_mmproj_gives_the_safetensors_tokens(files):
    checkpoint, text, mmproj = files
    image = drawn_image("red", (60, 40))  # split: 2 x 2 tiles and the global image
    from_safetensors = LLM(model=checkpoint, **ENGINE)
    expected = greedy_with_image(from_safetensors, image)
    del from_safetensors
    from_gguf = LLM(model=text, mmproj=mmproj, **ENGINE)
    config = from_gguf.engine.model_info.hf_config
    assert config.architectures == ["Idefics3ForConditionalGeneration"]
    assert (config.vision_config.image_size, config.vision_config.patch_size, config.scale_factor) == (32, 8, 2)
    assert config.image_processor_config["size"] == {"longest_edge": 64}
    prompt, tokens, logprobs = greedy_with_image(from_gguf, image)
    assert (prompt, tokens) == expected[:2]
    assert logprobs == pytest.approx(expected[2], abs=1e-4)
    other_prompt, other_tokens, _ = greedy_with_image(from_gguf, drawn_image("yellow", (60, 40)))
    assert other_prompt == prompt and other_tokens != tokens  # the image reaches the model


@needs_converter
def test_a_projector_file_tokenloom_cannot_use_is_refused(files, tmp_path):
    checkpoint, text, mmproj = files
    with pytest.raises(ConfigError, match="--mmproj goes with a GGUF model") as raised:
        LLM(model=checkpoint, mmproj=mmproj, **ENGINE)
    assert raised.value.param == "mmproj"
    with pytest.raises(ConfigError, match="not llama.cpp's clip vision projector"):
        LLM(model=text, mmproj=text, **ENGINE)
    with pytest.raises(ConfigError, match="no such file"):
        LLM(model=text, mmproj=str(tmp_path / "missing.gguf"), **ENGINE)


def test_serve_with_a_language_model_as_its_mmproj_is_one_line_naming_the_flag(smollm2_gguf, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "tokenloom", "serve", smollm2_gguf, "--mmproj", smollm2_gguf, "--port", "1"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert result.returncode != 0, result.stderr
    last_line = result.stderr.splitlines()[-1]
    assert last_line.startswith("tokenloom serve: error: --mmproj "), result.stderr
    assert "holds architecture 'llama', not llama.cpp's clip vision projector" in last_line, result.stderr
