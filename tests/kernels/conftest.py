"""Kernel tests run the real kernels on CUDA, and Triton's interpreter on CPU (numpy semantics, slow: small cases).

triton.jit reads TRITON_INTERPRET when a kernel is defined, so it is set here, before any test module imports
slora.kernels.*; a CUDA machine runs the compiled kernels.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import slora.kernels  # noqa: E402, F401 - with TRITON_INTERPRET set, its import fixes the interpreter (interpreter.py)
