"""GPTQ and AWQ checkpoints written in the tests, in the tensor layouts auto-gptq/gptqmodel and
AutoAWQ save (those tools need a GPU and do not install here), from a dense Hugging Face
directory: every linear layer quantized with a few lines of torch (round to nearest; GPTQ's error
feedback changes which codes are chosen, not how they are stored), and the LM head too with GPTQ's
``lm_head=True`` (as gptqmodel writes it: ``lm_head.qweight`` and the rest, made from the tied
embedding, beside the dense ``embed_tokens.weight``; config.json left as it was). Beside
each, the same model with the weights read back from the packed tensors by this module's own
unpacking (a loop over bit fields, written apart from tokenloom's), the reference tokenloom is
compared with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from helpers.compressed_tensors_files import LINEAR_SUFFIXES
from safetensors.torch import load_file, save_file

# modules that read the same input: GPTQ's act-order sorts their features alike
_SAME_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
# AWQ: the output feature of each 4-bit field of a word, low bits first
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits -> the same bit pattern as int32."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_fields(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Unsigned ``values`` packed ``32 / bits`` per int32 along ``dim``; field ``i`` (bits
    ``i*bits`` up) holds the value at position ``order[i]`` of its run (default ``i``)."""
    per_word = 32 // bits
    order = order or tuple(range(per_word))
    moved = values.to(torch.int64).movedim(dim, -1)
    runs = moved.reshape(*moved.shape[:-1], -1, per_word)
    words = torch.zeros(runs.shape[:-1], dtype=torch.int64)
    for field, position in enumerate(order):
        words |= runs[..., position] << (field * bits)
    return _as_int32(words).movedim(-1, dim).contiguous()


def unpack_fields(words: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """The inverse of :func:`pack_fields` (the reference's own reading of a checkpoint)."""
    per_word = 32 // bits
    order = order or tuple(range(per_word))
    moved = words.to(torch.int64).movedim(dim, -1) & 0xFFFFFFFF
    values = torch.zeros(*moved.shape, per_word, dtype=torch.int64)
    for field, position in enumerate(order):
        values[..., position] = (moved >> (field * bits)) & ((1 << bits) - 1)
    return values.reshape(*moved.shape[:-1], -1).movedim(-1, dim)


def _group_quantize(weight: torch.Tensor, members: list[torch.Tensor], bits: int, symmetric: bool):
    """Per group of input features (``members``: each group's feature indices): ``(codes [N, K],
    scales [G, N] float16, zero points [G, N])``, as GPTQ's quantizer chooses them."""
    maxq = 2**bits - 1
    codes = torch.zeros(weight.shape, dtype=torch.int64)
    scales, zeros = [], []
    for features in members:
        part = weight[:, features].float()
        low, high = part.amin(1).clamp(max=0), part.amax(1).clamp(min=0)
        if symmetric:
            high = torch.maximum(low.abs(), high)
            low = -high
        scale = ((high - low) / maxq).clamp(min=1e-6).half().float()
        zero = torch.full_like(scale, (maxq + 1) // 2) if symmetric else torch.round(-low / scale).clamp(0, maxq)
        codes[:, features] = (torch.round(part / scale[:, None]) + zero[:, None]).clamp(0, maxq).long()
        scales.append(scale.half())
        zeros.append(zero.long())
    return codes, torch.stack(scales), torch.stack(zeros)


def gptq_layer(
    weight: torch.Tensor,
    bits: int,
    group_size: int,
    symmetric: bool,
    checkpoint_format: str = "gptq",
    order: torch.Tensor | None = None,
):
    """One layer's GPTQ tensors (``order``: act-order's permutation of the input features)."""
    features = weight.shape[1]
    size = features if group_size == -1 else group_size
    order = torch.arange(features) if order is None else order
    g_idx = torch.empty(features, dtype=torch.int32)
    g_idx[order] = (torch.arange(features) // size).to(torch.int32)
    members = [order[start : start + size] for start in range(0, features, size)]
    codes, scales, zeros = _group_quantize(weight, members, bits, symmetric)
    stored_zeros = (zeros - (1 if checkpoint_format == "gptq" else 0)) & (2**bits - 1)
    return {
        "qweight": pack_fields(codes.t(), bits, dim=0),
        "qzeros": pack_fields(stored_zeros, bits, dim=1),
        "scales": scales,
        "g_idx": g_idx,
    }


def gptq_dequantize(tensors: dict[str, torch.Tensor], bits: int, checkpoint_format: str = "gptq") -> torch.Tensor:
    """The float32 ``[N, K]`` weight of GPTQ tensors, read as auto-gptq's torch kernel reads them
    (the classic format's zero point: the stored value plus one)."""
    codes = unpack_fields(tensors["qweight"], bits, dim=0).t()  # [N, K]
    zeros = unpack_fields(tensors["qzeros"], bits, dim=1) + (1 if checkpoint_format == "gptq" else 0)  # [G, N]
    g_idx = tensors["g_idx"].long()
    scales = tensors["scales"].float()
    return ((codes - zeros[g_idx].t()) * scales[g_idx].t()).float()


def awq_layer(weight: torch.Tensor, group_size: int):
    """One layer's AWQ GEMM tensors (asymmetric 4-bit, groups of consecutive features)."""
    features = weight.shape[1]
    members = [torch.arange(start, start + group_size) for start in range(0, features, group_size)]
    codes, scales, zeros = _group_quantize(weight, members, 4, symmetric=False)
    return {
        "qweight": pack_fields(codes.t(), 4, dim=1, order=AWQ_ORDER),
        "qzeros": pack_fields(zeros, 4, dim=1, order=AWQ_ORDER),
        "scales": scales,
    }


def awq_dequantize(tensors: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    codes = unpack_fields(tensors["qweight"], 4, dim=1, order=AWQ_ORDER)  # [K, N]
    zeros = unpack_fields(tensors["qzeros"], 4, dim=1, order=AWQ_ORDER)  # [G, N]
    groups = torch.arange(codes.shape[0]) // group_size
    return ((codes - zeros[groups]) * tensors["scales"].float()[groups]).t().float()


def gptq_config(
    bits=4, group_size=128, symmetric=True, desc_act=False, checkpoint_format="gptq", lm_head=False
) -> dict:
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": symmetric,
        "static_groups": False,
        "true_sequential": True,
        "damp_percent": 0.01,
        "lm_head": lm_head,
        "checkpoint_format": checkpoint_format,
    }


def awq_config(group_size=128) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}


def write_quantized(dense_dir: str, out_dir: Path, method: str, **options) -> tuple[str, str]:
    """``(quantized directory, dequantized reference directory)`` made from ``dense_dir``;
    ``method`` "gptq" (options of :func:`gptq_config`) or "awq" (``group_size``)."""
    quantized, reference = out_dir / "quantized", out_dir / "reference"
    for directory in (quantized, reference):
        shutil.copytree(dense_dir, directory)
        for stale in directory.glob("*.safetensors*"):
            stale.unlink()
    config = gptq_config(**options) if method == "gptq" else awq_config(**options)
    generator = torch.Generator().manual_seed(11)
    orders: dict[str, torch.Tensor] = {}
    packed: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    dense = load_file(str(Path(dense_dir) / "model.safetensors"))
    quantized_names = LINEAR_SUFFIXES
    if config.get("lm_head"):
        # a tied checkpoint holds the head as the embedding: the head's codes are made from it
        dense.setdefault("lm_head.weight", dense["model.embed_tokens.weight"])
        quantized_names += ("lm_head.weight",)
    for name, tensor in dense.items():
        if not name.endswith(quantized_names):
            packed[name] = dequantized[name] = tensor.contiguous()
            continue
        module = name.removesuffix(".weight")
        if method == "awq":
            tensors = awq_layer(tensor, config["group_size"])
            value = awq_dequantize(tensors, config["group_size"])
        else:
            order = None
            if config["desc_act"]:
                parent, _, leaf = module.rpartition(".")
                shared = f"{parent}.{_SAME_INPUT.get(leaf, leaf)}"
                order = orders.setdefault(shared, torch.randperm(tensor.shape[1], generator=generator))
            fmt = config["checkpoint_format"]
            tensors = gptq_layer(tensor, config["bits"], config["group_size"], config["sym"], fmt, order)
            value = gptq_dequantize(tensors, config["bits"], fmt)
        packed.update({f"{module}.{key}": value_ for key, value_ in tensors.items()})
        dequantized[name] = value.to(tensor.dtype).contiguous()
    save_file(packed, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(reference / "model.safetensors"), metadata={"format": "pt"})
    hf_config = json.loads((Path(dense_dir) / "config.json").read_text())
    if config.get("lm_head"):  # the reference's head is the dequantized one, not the embedding
        reference_config = {**hf_config, "tie_word_embeddings": False}
        (reference / "config.json").write_text(json.dumps(reference_config, indent=2))
    hf_config["quantization_config"] = config
    (quantized / "config.json").write_text(json.dumps(hf_config, indent=2))
    return str(quantized), str(reference)
