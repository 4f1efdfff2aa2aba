"""compressed-tensors checkpoints written in the tests, as llm-compressor writes them (its
config.json ``quantization_config`` and tensor names), from a dense Hugging Face directory:
every linear layer but the LM head quantized with a few lines of torch. Beside each, the same
model with the quantized weights dequantized back to float32 (what transformers' compressed-tensors
integration decompresses to), the reference tokenloom is compared with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEAR_SUFFIXES = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)


def write_random_llama(directory: Path, smollm2_gguf: str) -> str:
    """A tiny random Llama wide enough for groups of 128 (hidden 128, 2 layers), weights large
    enough that greedy decoding is not degenerate, with SmolLM2's tokenizer (and chat template)."""
    from helpers.model_parity import randomize_parameters
    from helpers.tiny_llama import tiny_llama_config
    from transformers import LlamaForCausalLM

    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat

    tokenizer = GGUFLoadFormat().load_tokenizer(smollm2_gguf, None)
    tokenizer.save_pretrained(directory)
    config = tiny_llama_config(tokenizer, hidden_size=128, intermediate_size=256)
    torch.manual_seed(0)
    randomize_parameters(LlamaForCausalLM(config).eval()).save_pretrained(directory)
    return str(directory)


def pack_int4(values: torch.Tensor, dim: int, bits: int = 4) -> torch.Tensor:
    """Signed 4-bit values (-8..7) packed eight per int32 along ``dim``, the first in the low
    bits, each stored plus 8 (compressed-tensors' pack_to_int32); ``bits=8``: signed 8-bit values
    four per int32, each plus 128."""
    unsigned = (values.to(torch.int32) + (1 << (bits - 1))).movedim(dim, -1)
    grouped = unsigned.reshape(*unsigned.shape[:-1], -1, 32 // bits)
    packed = (grouped << torch.arange(0, 32, bits, dtype=torch.int32)).sum(-1, dtype=torch.int64)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the bit pattern as int32
    return packed.movedim(-1, dim).contiguous()


def quantize_w4a16(weight: torch.Tensor, group_size: int | None, symmetric: bool):
    """``(tensors, dequantized)``: the checkpoint tensors of one layer and its float32 value."""
    rows, cols = weight.shape
    group = group_size or cols
    grouped = weight.float().reshape(rows, cols // group, group)
    if symmetric:
        scale = grouped.abs().amax(-1) / 7.5
        zero_point = torch.zeros_like(scale, dtype=torch.int32)
    else:
        low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
        scale = (high - low) / 15
        zero_point = (-8 - torch.round(low / scale)).clamp(-8, 7).to(torch.int32)
    scale = scale.clamp(min=1e-8).to(torch.bfloat16).float()  # as llm-compressor stores it
    q = (torch.round(grouped / scale.unsqueeze(-1)) + zero_point.unsqueeze(-1)).clamp(-8, 7)
    dequantized = ((q - zero_point.unsqueeze(-1)) * scale.unsqueeze(-1)).reshape(rows, cols)
    tensors = {
        "weight_packed": pack_int4(q.reshape(rows, cols), dim=1),
        "weight_scale": scale.to(torch.bfloat16),
        "weight_shape": torch.tensor([rows, cols], dtype=torch.int64),
    }
    if not symmetric:
        tensors["weight_zero_point"] = pack_int4(zero_point, dim=0)
    return tensors, dequantized


def quantize_w8a8(weight: torch.Tensor):
    scale = (weight.float().abs().amax(-1, keepdim=True) / 127).clamp(min=1e-8).to(torch.bfloat16).float()
    q = torch.round(weight.float() / scale).clamp(-128, 127)
    return {"weight": q.to(torch.int8), "weight_scale": scale.to(torch.bfloat16)}, q * scale


def quantize_w8a16(weight: torch.Tensor, group_size: int | None):
    """pack-quantized 8-bit weights (what llm-compressor writes for W8A16): four codes per int32."""
    rows, cols = weight.shape
    grouped = weight.float().reshape(rows, cols // (group_size or cols), -1)
    scale = (grouped.abs().amax(-1) / 127).clamp(min=1e-8).to(torch.bfloat16).float()
    q = torch.round(grouped / scale.unsqueeze(-1)).clamp(-128, 127)
    tensors = {
        "weight_packed": pack_int4(q.reshape(rows, cols), dim=1, bits=8),
        "weight_scale": scale.to(torch.bfloat16),
        "weight_shape": torch.tensor([rows, cols], dtype=torch.int64),
    }
    return tensors, (q * scale.unsqueeze(-1)).reshape(rows, cols)


def quantize_fp8(weight: torch.Tensor, per_tensor: bool):
    """float8_e4m3fn weights, one scale per output channel (``[out, 1]``) or per tensor (``[1]``)."""
    amax = weight.float().abs().amax() if per_tensor else weight.float().abs().amax(-1, keepdim=True)
    scale = (amax / 448).clamp(min=1e-8).to(torch.bfloat16).float().reshape(1 if per_tensor else -1, 1)
    q = (weight.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    stored = scale.reshape(1) if per_tensor else scale
    return {"weight": q, "weight_scale": stored.to(torch.bfloat16)}, q.float() * scale


# the FP8 schemes: llm-compressor's presets FP8 (tensor weights, static tensor activations) and
# FP8_DYNAMIC (channel weights, dynamic token activations), and FP8 weights alone
FP8_SCHEMES = {
    "FP8": ("tensor", "tensor", False),
    "FP8_DYNAMIC": ("channel", "token", True),
    "FP8_W8A16": ("channel", None, None),
}


def scheme_config(scheme: str, group_size: int | None = 32, symmetric: bool = True, static: bool = False) -> dict:
    """config.json's ``quantization_config`` for ``scheme`` ("W4A16", "W8A8", "W8A16" or one of
    :data:`FP8_SCHEMES`)."""
    if scheme in FP8_SCHEMES:
        weight_strategy, activation_strategy, dynamic = FP8_SCHEMES[scheme]
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": weight_strategy, "dynamic": False}
        activations = None
        if activation_strategy is not None:
            activations = {
                "num_bits": 8,
                "type": "float",
                "symmetric": True,
                "strategy": activation_strategy,
                "dynamic": dynamic,
            }
        fmt = "float-quantized"
    elif scheme in ("W4A16", "W8A16"):
        weights = {
            "num_bits": 4 if scheme == "W4A16" else 8,
            "type": "int",
            "symmetric": symmetric,
            "strategy": "group" if group_size else "channel",
            "group_size": group_size,
            "dynamic": False,
            "actorder": None,
            "observer": "minmax",
        }
        activations, fmt = None, "pack-quantized"
    else:
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
        activations = {
            "num_bits": 8,
            "type": "int",
            "symmetric": True,
            "strategy": "tensor" if static else "token",
            "dynamic": not static,
        }
        fmt = "int-quantized"
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": activations,
                "output_activations": None,
                "format": fmt,
            }
        },
    }


def write_compressed(
    dense_dir: str, out_dir: Path, scheme: str, group_size: int | None = 32, symmetric: bool = True, static=False
) -> tuple[str, str]:
    """``(compressed directory, dequantized reference directory)`` made from ``dense_dir``."""
    compressed, reference = out_dir / "compressed", out_dir / "reference"
    for directory in (compressed, reference):
        shutil.copytree(dense_dir, directory)
        for stale in directory.glob("*.safetensors*"):
            stale.unlink()
    state = load_file(str(Path(dense_dir) / "model.safetensors"))
    packed: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if not name.endswith(LINEAR_SUFFIXES):
            packed[name] = dequantized[name] = tensor.contiguous()
            continue
        module = name.removesuffix(".weight")
        if scheme == "W4A16":
            tensors, value = quantize_w4a16(tensor, group_size, symmetric)
        elif scheme == "W8A16":
            tensors, value = quantize_w8a16(tensor, group_size)
        elif scheme in FP8_SCHEMES:
            tensors, value = quantize_fp8(tensor, per_tensor=FP8_SCHEMES[scheme][0] == "tensor")
            if FP8_SCHEMES[scheme][2] is False:  # static activation scales
                tensors["input_scale"] = torch.tensor([0.02], dtype=torch.bfloat16)
        else:
            tensors, value = quantize_w8a8(tensor)
            if static:
                tensors["input_scale"] = torch.tensor([0.02], dtype=torch.bfloat16)
        packed.update({f"{module}.{key}": value_ for key, value_ in tensors.items()})
        dequantized[name] = value.to(tensor.dtype).contiguous()
    save_file(packed, str(compressed / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(reference / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(dense_dir) / "config.json").read_text())
    config["quantization_config"] = scheme_config(scheme, group_size, symmetric, static)
    (compressed / "config.json").write_text(json.dumps(config, indent=2))
    return str(compressed), str(reference)
