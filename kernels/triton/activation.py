"""SwiGLU in one pass: act = SiLU(gate) · up, read from the fused gate/up projection's output [gate | up].

The torch form (F.silu, then a multiply) writes SiLU(gate) to memory and reads it back, in two launches. Here each
program reads a BLOCK of gate and of up of one token row and writes the product once. The roundings are the
reference's (activation_ref.py): SiLU is computed in float32 and rounded to the model dtype, then multiplied by
up in float32 and rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slora.kernels.triton.launch import cdiv
from slora.kernels.triton.relaunch import launch_cached

BLOCK = 1024  # columns per program


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [num_tokens, 2 * inter], unit column stride
    stride_gate_up,
    out_ptr,  # [num_tokens, inter], contiguous
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_gate_up + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_gate_up + inter + cols, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * inter + cols, out.to(gate.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """SiLU(gate_up[:, :inter]) · gate_up[:, inter:] as a new contiguous [num_tokens, inter] tensor."""
    if gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.shape[1] != 2 * inter:
        raise ValueError(
            f"gate_up must be [num_tokens, {2 * inter}] with unit column stride, got {tuple(gate_up.shape)}"
        )
    num_tokens = gate_up.shape[0]
    out = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        grid = (num_tokens, cdiv(inter, BLOCK))
        launch_cached(_silu_mul_kernel, grid, gate_up, gate_up.stride(0), out, inter, BLOCK=BLOCK)
    return out
