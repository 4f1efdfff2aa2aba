"""The CPU path never imports triton (the ``gpu`` extra): not the platforms, the layers, the
attention-backend choice or the gguf method; only a Triton kernel module does. Runs whether or
not triton is installed."""

from __future__ import annotations

import subprocess
import sys


def test_the_cpu_path_does_not_import_triton():
    code = (
        "import os, sys; os.environ.pop('TRITON_INTERPRET', None)\n"
        "import tokenloom.builtin_plugins.platforms.cuda, tokenloom.builtin_plugins.platforms.cpu\n"
        "import tokenloom.builtin_plugins.quantization.gguf, tokenloom.kernels.triton.layers\n"
        "import tokenloom.kernels.triton.gguf, tokenloom.layers.layernorm, tokenloom.layers.rotary\n"
        "from tokenloom.core.platform import check_attention_backend\n"
        "from tokenloom.plugins.manager import load_plugins\n"
        "check_attention_backend('triton', load_plugins().registry('attention_backend'))\n"
        "import torch\n"
        "from tokenloom.kernels.cpu_native import ops_for\n"
        "ops_for(torch.ones(1))\n"
        "print('triton' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
