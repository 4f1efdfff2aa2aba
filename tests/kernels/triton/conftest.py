"""The Triton kernels' tests run on the CPU under Triton's interpreter. Triton reads
TRITON_INTERPRET when ``@triton.jit`` decorates a kernel, i.e. when a module of kernels is
first imported: it is set here, before any test module imports one (tokenloom imports them
lazily, so nothing earlier in the session has)."""

import os

os.environ["TRITON_INTERPRET"] = "1"
