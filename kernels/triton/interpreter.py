"""Fixes for Triton's CPU interpreter (TRITON_INTERPRET=1), applied when slora.kernels is imported under it.

The interpreter runs the kernels with numpy semantics; two of its bfloat16 behaviours (triton 3.9) differ from
the GPU's and would make any bf16 result wrong or off by an ulp on CPU: the kernel tests, `perf.bench_kernels
--smoke` and an engine with kernel_backend=triton on CPU all run through it. Nothing changes on a GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from slora.kernels.settings import triton_interpreted


def patch_interpreter() -> None:
    """Apply both fixes once, if this process runs Triton's interpreter."""
    if not triton_interpreted() or _PATCHED:
        return
    _patch_interpreter_bf16_dot()
    _patch_interpreter_bf16_rounding()
    _PATCHED.append(True)


_PATCHED: list[bool] = []


def _patch_interpreter_bf16_dot() -> None:
    """Make the interpreter's tl.dot read bfloat16 operands as numbers.

    The interpreter keeps bfloat16 values as their raw uint16 bits, and its dot multiplies those bits as integers
    (triton 3.9), so any bf16 tl.dot returns garbage on CPU. A bfloat16 is the top half of a float32: widen the
    bits and multiply in float32, as the GPU's tensor cores do (exact products, float32 accumulation).
    """
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
    except ImportError:
        return
    create_dot = InterpreterBuilder.create_dot

    def widen(handle: TensorHandle) -> TensorHandle:
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        return TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    InterpreterBuilder.create_dot = dot


def _patch_interpreter_bf16_rounding() -> None:
    """Make the interpreter round float32 → bfloat16 to nearest even, as the GPU and torch do.

    Triton 3.9's interpreter truncates that cast (toward zero), so every bf16 result of a kernel would differ from
    torch's by up to an ulp on CPU, and exact checks (a residual sum) could not pass.
    """
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
    except ImportError:
        return
    cast_impl = InterpreterBuilder.cast_impl

    def cast(self: InterpreterBuilder, src: TensorHandle, dst_type: tl.dtype) -> TensorHandle:
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast_impl(self, src, dst_type)
        bits = np.asarray(src.data, dtype=np.float32).view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16
        quiet_nan = (bits >> 16) | np.uint32(0x40)
        return TensorHandle(np.where(np.isnan(src.data), quiet_nan, rounded).astype(np.uint16), tl.bfloat16)

    InterpreterBuilder.cast_impl = cast
