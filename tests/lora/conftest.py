# `isa_level`: a module that uses it runs once per CPU kernel level the host runs (test_lora_kernels)
from helpers.isa_levels import isa_level  # noqa: F401
