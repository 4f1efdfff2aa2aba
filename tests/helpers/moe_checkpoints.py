"""Tiny mixture-of-experts checkpoints as their GGUF files hold them: a transformers model whose
weights are replaced by their values after a round trip through a GGUF block type (what
``helpers.gguf_files.write_model_gguf`` quantizes), and llama.cpp's ``llama-quantize`` (Q4_K_M,
which the ``gguf`` package cannot write) with the quantized file's values read back into the model."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize
from helpers.gguf_files import gguf_name

# where this project's llama.cpp build puts llama-quantize; TOKENLOOM_LLAMA_QUANTIZE or PATH override
LLAMA_QUANTIZE = "/work/peer/llama.cpp-src/build/bin/llama-quantize"
ROUTERS = (".mlp.gate.weight", ".mlp.shared_expert_gate.weight")  # kept F32 by the converter


def llama_quantize() -> str | None:
    """The path of a ``llama-quantize`` executable, or None."""
    for candidate in (os.environ.get("TOKENLOOM_LLAMA_QUANTIZE"), shutil.which("llama-quantize"), LLAMA_QUANTIZE):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def through_quant_type(hf_model, quant_type: GGMLQuantizationType):
    """``hf_model`` with every weight ``write_model_gguf(quant_type=..., expert_quant_type=...)``
    quantizes (matrices whose rows fit the blocks, every expert; never a router) replaced by its
    value after the round trip through ``quant_type``."""
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if param.dim() < 2 or param.shape[-1] % 32 or name.endswith(ROUTERS):
                continue
            data = param.detach().float().numpy()
            param.copy_(torch.from_numpy(dequantize(quantize(data, quant_type), quant_type).reshape(data.shape)))
    return hf_model


def quantize_with_llama_cpp(source: str, target: str, kind: str = "Q4_K_M") -> str:
    """``llama-quantize source target kind``; the caller checks :func:`llama_quantize` first."""
    executable = llama_quantize()
    assert executable is not None
    subprocess.run([executable, source, target, kind], check=True, capture_output=True)
    return target


def with_gguf_values(hf_model, architecture: str, path: str):
    """``hf_model`` holding the values of the GGUF file at ``path`` (written from it by
    ``write_model_gguf`` and perhaps quantized since): each tensor dequantized, the stacked
    experts put back as transformers' ``gate_up_proj`` / ``down_proj``."""
    values = {}
    for tensor in GGUFReader(path).tensors:
        shape = tuple(int(size) for size in reversed(tensor.shape.tolist()))
        values[tensor.name] = dequantize(np.asarray(tensor.data), GGMLQuantizationType(tensor.tensor_type)).reshape(
            shape
        )
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            match = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
            if match:
                block = f"blk.{match.group(1)}"
                if match.group(2) == "down_proj":
                    value = values[f"{block}.ffn_down_exps.weight"]
                else:
                    value = np.concatenate(
                        [values[f"{block}.ffn_gate_exps.weight"], values[f"{block}.ffn_up_exps.weight"]], axis=1
                    )
            elif name == "lm_head.weight" and "output.weight" not in values:
                value = values["token_embd.weight"]
            else:
                value = values[gguf_name(architecture, name)]
            param.copy_(torch.from_numpy(np.array(value, dtype=np.float32)).reshape(param.shape))
    return hf_model
