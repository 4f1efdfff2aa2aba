"""A tiny random SmolVLM (``Idefics3ForConditionalGeneration``) checkpoint as transformers saves
one: a 2-layer SigLIP vision tower over 32x32 frames in 8-pixel patches (16 patches, pixel
shuffle by 2: 4 image tokens a frame), a 2-layer Llama with SmolLM2's tokenizer plus SmolVLM's
image tokens (``<fake_token_around_image>``, ``<image>``, ``<global-img>``, ``<row_r_col_c>``),
and a real Idefics3Processor configuration: images resized to a 64-pixel longest edge, split
into 32-pixel tiles plus the global image, with SmolVLM's chat template. The same with random
weights of SmolVLM-256M's real shape (for benchmarks), and the llama.cpp conversion of either
into the language model's GGUF and its ``mmproj`` file."""

from __future__ import annotations

import torch

CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}: {{ message['content'] }}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<image>{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
IMAGE_SEQ_LEN = 4  # (32 / 8) ** 2 patches / 2 ** 2
FRAME_SIZE = 32
RESIZED_LONGEST_EDGE = 64  # a split image: 2 x 2 tiles and the global image
TEXT_HIDDEN_SIZE = 64

# the shapes write_idefics3 builds: the tests' tiny one, and SmolVLM-256M-Instruct's (for benchmarks)
SHAPES = {
    "tiny": {
        "vision": dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=FRAME_SIZE,
            patch_size=8,
        ),
        "text": dict(
            hidden_size=TEXT_HIDDEN_SIZE,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
        ),
        "scale_factor": 2,
        "resized_longest_edge": RESIZED_LONGEST_EDGE,
    },
    "smolvlm-256m": {
        "vision": dict(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            image_size=512,
            patch_size=16,
        ),
        "text": dict(
            vocab_size=49280,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            rope_theta=100000.0,
        ),
        "scale_factor": 4,
        "resized_longest_edge": 2048,
    },
}


def write_tiny_idefics3(directory, smollm2_gguf: str, *, seed: int = 0):
    """Save the tiny checkpoint into ``directory``; returns the transformers model (float32, eval)."""
    return write_idefics3(directory, smollm2_gguf, "tiny", seed=seed)


def write_idefics3(directory, smollm2_gguf: str, shape: str, *, seed: int = 0):
    """Save a random checkpoint of one of :data:`SHAPES` into ``directory``; returns the
    transformers model (float32, eval)."""
    from helpers.model_parity import randomize_parameters
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
    )

    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat

    sizes = SHAPES[shape]
    tokenizer = GGUFLoadFormat().load_tokenizer(smollm2_gguf, None)
    markers = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    markers += [f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)]
    tokenizer.add_special_tokens({"additional_special_tokens": markers})
    vision = Idefics3VisionConfig(**sizes["vision"])
    text = LlamaConfig(
        **{"vocab_size": len(tokenizer), **sizes["text"]},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=0,
        architectures=["VLlama3ForCausalLM"],  # as SmolVLM's text_config names it (llama.cpp's converter reads it)
    )
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=sizes["scale_factor"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = randomize_parameters(Idefics3ForConditionalGeneration(config), seed=seed).eval()
    model.save_pretrained(directory)
    frame_size = vision.image_size
    image_processor = Idefics3ImageProcessor(
        size={"longest_edge": sizes["resized_longest_edge"]}, max_image_size={"longest_edge": frame_size}
    )
    image_seq_len = (frame_size // vision.patch_size) ** 2 // sizes["scale_factor"] ** 2
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=image_seq_len, chat_template=CHAT_TEMPLATE
    )
    processor.save_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return model


# llama.cpp's checkout (its convert_hf_to_gguf.py); TOKENLOOM_LLAMA_CPP_SRC overrides
LLAMA_CPP_SRC = "/work/peer/llama.cpp-src"


def llama_cpp_converter() -> str | None:
    """The path of llama.cpp's ``convert_hf_to_gguf.py``, or None."""
    import os

    path = os.path.join(os.environ.get("TOKENLOOM_LLAMA_CPP_SRC", LLAMA_CPP_SRC), "convert_hf_to_gguf.py")
    return path if os.path.isfile(path) else None


def convert_with_llama_cpp(checkpoint: str, out_dir, outtype: str = "f32") -> tuple[str, str]:
    """The checkpoint as llama.cpp ships SmolVLM: the language model's GGUF and the ``mmproj``
    GGUF of the vision tower and projector (``convert_hf_to_gguf.py`` and ``--mmproj``, in
    ``outtype``, both conversions at once); the caller checks :func:`llama_cpp_converter` first."""
    import os
    import subprocess
    import sys

    converter = llama_cpp_converter()
    assert converter is not None
    text = os.path.join(out_dir, f"smolvlm-{outtype}.gguf")
    mmproj = os.path.join(out_dir, f"mmproj-smolvlm-{outtype}.gguf")
    runs = [
        subprocess.Popen(
            [sys.executable, converter, checkpoint, "--outtype", outtype, "--outfile", path, *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for path, extra in ((text, []), (mmproj, ["--mmproj"]))
    ]
    for run in runs:
        output, _ = run.communicate()
        assert run.returncode == 0, output.decode()[-2000:]
    return text, mmproj
