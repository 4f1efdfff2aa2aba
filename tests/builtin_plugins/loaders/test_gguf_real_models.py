"""The ``gguf`` load format on the real packaged models (SmolLM2 Q4_1, Gemma 3 270M Q4_K_M):
config, tokenizer and every weight against transformers' own GGUF conversion."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat
from tokenloom.builtin_plugins.quantization.gguf_blocks import GGUFWeight
from tokenloom.core.config import ModelConfig

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world! How are you today?",
    " leading space and  double  spaces   and trailing ",
    "emoji: 🤗🚀👍🏽 and flags 🇫🇷",
    "中文字符，日本語のテキスト、한국어 텍스트",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\n# done\t\ttabs",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>",
    "<bos><start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    '{"key": [1, 2.5, -3e10], "nested": {"a": null}}',
    "     \n\n\n    ",
    "Ünïcödé façade naïve café — “quotes” … ½",
    "x" * 300,
    "",
]


@pytest.fixture(scope="module", autouse=True)
def one_reference_reader_per_file():
    """transformers' GGUF conversion opens each file with ``gguf.GGUFReader``, which parses every
    metadata entry into numpy objects (Gemma 3's 262k-token vocabulary: most of a test's time),
    on every call; the tokenizer and weight tests below call it for the same files. The reader
    only reads, so each file is parsed once and its reader shared (tokenloom's own loader has a
    reader of its own, which this does not touch)."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def shared_reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", shared_reader)
        yield


@pytest.fixture(scope="module")
def gemma3_gguf() -> str:
    from tokenloom.builtin_plugins.model_sources.pip_packages import PipPackageModelSource

    return PipPackageModelSource().resolve("gemma3-270m").path


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def real_model(request, smollm2_gguf):
    path = smollm2_gguf if request.param == "smollm2" else request.getfixturevalue("gemma3_gguf")
    return request.param, path


@functools.cache
def transformers_config(path):
    """transformers' config conversion (slow: it parses the whole vocabulary), once per file."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def test_config_equals_transformers_conversion(real_model):
    name, path = real_model
    ours = GGUFLoadFormat().load_config(path, ModelConfig())
    reference = transformers_config(path)
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rope_parameters",
        "vocab_size",
        "rms_norm_eps",
        "tie_word_embeddings",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "intermediate_size",
    ):
        assert getattr(ours, key) == getattr(reference, key), key
    ours_dict, reference_dict = ours.to_dict(), reference.to_dict()
    for key in ("_name_or_path", "_model_name_or_path", "architectures", "transformers_version"):
        ours_dict.pop(key, None), reference_dict.pop(key, None)
    assert ours_dict == reference_dict
    expected = {
        "smollm2": dict(
            hidden_size=576,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
            bos_token_id=1,
            eos_token_id=2,
            architectures=["LlamaForCausalLM"],
        ),
        "gemma3": dict(
            hidden_size=640,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            vocab_size=262144,
            sliding_window=512,
            bos_token_id=2,
            eos_token_id=1,
            architectures=["Gemma3ForCausalLM"],
        ),
    }[name]
    for key, value in expected.items():
        assert getattr(ours, key) == value, key


def test_tokenizer_gives_the_same_ids_and_text_as_transformers(real_model):
    from transformers import AutoTokenizer

    _, path = real_model
    ours = GGUFLoadFormat().load_tokenizer(path, ModelConfig())
    reference = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for text in TEXTS:
        ids = ours(text).input_ids
        assert ids == reference(text).input_ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert ours(TEXTS[0], add_special_tokens=False).input_ids == reference(TEXTS[0], add_special_tokens=False).input_ids
    assert len(ours) == len(reference)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (
        reference.bos_token_id,
        reference.eos_token_id,
        reference.pad_token_id,
        reference.unk_token_id,
    )
    assert ours.chat_template == reference.chat_template


def test_smollm2_tokenizer_carries_its_chat_template(smollm2_gguf):
    tokenizer = GGUFLoadFormat().load_tokenizer(smollm2_gguf, ModelConfig())
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_every_weight_maps_to_transformers_with_equal_dequantized_values(real_model):
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _, path = real_model
    config = transformers_config(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected_shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    reference = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    seen = set()
    for name, weight in GGUFLoadFormat().iterate_weights(path, None, None):
        assert name in expected_shapes, name
        assert tuple(weight.shape) == tuple(expected_shapes[name]), name
        values = weight.dequantize() if isinstance(weight, GGUFWeight) else weight.float()
        assert torch.equal(values, reference.pop(name).float()), name
        seen.add(name)
    assert not reference  # every tensor transformers loads, we yield too
    assert set(expected_shapes) - seen <= {"lm_head.weight"}  # tied to the embedding


def test_smollm2_quantization_and_whole_model_dequantization(smollm2_gguf):
    load_format = GGUFLoadFormat()
    assert load_format.quantization(smollm2_gguf) == "gguf"
    types = {
        weight.type_name
        for _, weight in load_format.iterate_weights(smollm2_gguf, None, None)
        if isinstance(weight, GGUFWeight)
    }
    assert types == {"Q4_1", "Q8_0"}
