"""A Triton GEMM for decode steps' projections, y = x·Wᵀ (+ bias) (gemm_launch).

It serves steps of up to 64 rows (kernels/triton/projection.py), where a projection reads its weight once and does
little arithmetic, and it lets the LoRA shrink behind it start early (kernels/triton/pdl.py): each program lets the
dependent launch start as it begins, which cuBLAS's launches do not.

Columns: the call's modules side by side from column 0, each column block inside one module (block_n divides every
width), as the LoRA's expand splits them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from slora.kernels.triton.launch import cdiv, dot_precision, next_power_of_2
from slora.kernels.triton.relaunch import Relaunch


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # rows per program at most (fewer rows: the next power of two, at least 16)
    block_n: int  # columns per program at most (less where a module's width needs it)
    block_k: int
    num_warps: int
    num_stages: int


def gemm_config(m: int, n: int, k: int) -> GemmConfig:
    """The config for x [m, k] · Wᵀ [k, n]: per row range, the fastest of perf.bench_lora_gemm's sweep for each 7B
    projection on the H200 (perf/RESULTS.md)."""
    if m <= 16:
        if n >= 16384:
            return GemmConfig(16, 64, 128, 4, 3)
        if k >= 8192:
            return GemmConfig(16, 32, 256, 4, 6)
        return GemmConfig(16, 32, 256 if n <= 8192 else 128, 4, 4)
    if m <= 64:
        if n >= 16384:
            return GemmConfig(64, 128, 64, 4, 4)
        if n <= 8192 or k >= 8192:
            return GemmConfig(64, 32, 256, 4, 4)
        return GemmConfig(64, 128, 128, 4, 4)
    return GemmConfig(128, 64, 128, 8, 4)


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(
    x_ptr,  # [M, K], unit column stride
    stride_x,
    w_ptr,  # [N, K], unit column stride
    stride_w,
    bias_ptr,  # [N] (read when HAS_BIAS)
    y_ptr,  # [M, N], unit column stride (written)
    stride_y,
    M,
    K,
    n_blocks,  # column blocks: program p takes column block p % n_blocks, row block p // n_blocks
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,  # let the LoRA shrink behind this GEMM start now (kernels/triton/pdl.py)
):
    if USE_PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    n0 = (pid % n_blocks) * BLOCK_N
    rows = (pid // n_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    n = n0 + tl.arange(0, BLOCK_N)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        xt = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        wt = tl.load(w_rows + k[None, :], mask=k_mask[None, :], other=0.0)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_y + n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None])


def gemm_launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    bias: torch.Tensor | None = None,
    cfg: GemmConfig | None = None,
    widths: tuple[int, ...] | None = None,
    pdl: bool = False,
) -> Relaunch:
    """The launch of y = x·Wᵀ (+ bias), called as launch(x, weight, y) (launch(x, weight, y, bias) with a bias) for
    tensors shaped like these (every layer of a step); widths (default: one module of N columns) only limits the
    column block (see top). pdl: let a LoRA shrink launched with PDL behind this GEMM start early (pdl.shrink_pdl)."""
    widths = widths or (weight.shape[0],)
    _check(x, weight, y, bias, widths)
    m, k = x.shape
    n = weight.shape[0]
    cfg = cfg or gemm_config(m, n, k)
    block_m = min(cfg.block_m, max(16, next_power_of_2(m)))
    block_n = column_block(cfg.block_n, widths)
    n_blocks = cdiv(n, block_n)
    args: dict[str, object] = dict(
        x_ptr=x, stride_x=x.stride(0), w_ptr=weight, stride_w=weight.stride(0),
        bias_ptr=weight if bias is None else bias, y_ptr=y, stride_y=y.stride(0), M=m, K=k, n_blocks=n_blocks,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION=dot_precision(x.dtype), USE_PDL=pdl,
    )  # fmt: skip
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    changing = ("x_ptr", "w_ptr", "y_ptr") + (() if bias is None else ("bias_ptr",))
    return Relaunch(_gemm_kernel, (n_blocks * cdiv(m, block_m),), args, options, changing=changing)


def column_block(block_n: int, widths: tuple[int, ...]) -> int:
    """The widest power of two up to block_n that divides every module's width: no column block straddles two
    modules (at least 16, which every projection width of the models served here is a multiple of)."""
    common = math.gcd(*widths)
    return max(16, min(block_n, common & -common))


def _check(
    x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, widths: tuple[int, ...]
) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} are not [M, K] and [N, K]")
    if x.stride(1) != 1 or weight.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("x, weight and y need a unit column stride")
    if tuple(y.shape) != (x.shape[0], weight.shape[0]) or y.dtype != x.dtype or weight.dtype != x.dtype:
        raise ValueError(f"y must be {x.dtype} [{x.shape[0]}, {weight.shape[0]}], got {y.dtype} {tuple(y.shape)}")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{weight.shape[0]}], got {tuple(bias.shape)}")
    if sum(widths) != weight.shape[0] or not 1 <= len(widths) <= 3:
        raise ValueError(f"1 to 3 module widths summing to {weight.shape[0]} expected, got {widths}")
    if any(w % 16 for w in widths):
        raise ValueError(f"module widths must be multiples of 16, got {widths}")
