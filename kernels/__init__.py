"""Triton-language kernels with their torch references; under TRITON_INTERPRET=1 the interpreter is fixed first."""

from slora.kernels.triton.interpreter import patch_interpreter

patch_interpreter()
