"""Compute primitives: a torch reference for every op, fast CPU paths, Triton kernels."""
