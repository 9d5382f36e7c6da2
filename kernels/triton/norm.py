"""RMSNorm fused with the residual add before it: s = x + residual; out = weight * RMSNorm(s).

One program per token row holds the whole row (BLOCK = next power of two >= hidden, masked past hidden), so the
sum of squares and the scaling read s from registers and each element is loaded and stored once. The roundings
are Hugging Face Llama's: s is rounded to the model dtype, the statistics and the scaling are float32, the
normalized row is rounded to the model dtype, then multiplied by the weight in float32 and rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slora.kernels.triton.launch import next_power_of_2
from slora.kernels.triton.relaunch import launch_cached

NORM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden], unit stride along hidden
    stride_x,
    residual_ptr,  # like x; read only when HAS_RESIDUAL
    stride_residual,
    weight_ptr,  # [hidden], contiguous
    out_ptr,  # [num_tokens, hidden], contiguous: weight * RMSNorm(s)
    s_ptr,  # [num_tokens, hidden], contiguous: x + residual; written only when HAS_RESIDUAL
    eps,
    HIDDEN: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= HIDDEN
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    s = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # Float32 holds more than twice the bits of a half type, so this rounds once, exactly as torch's x + r.
        s = (s.to(tl.float32) + residual.to(tl.float32)).to(s.dtype)
        tl.store(s_ptr + row * HIDDEN + cols, s, mask=mask)
    s32 = s.to(tl.float32)
    variance = tl.sum(s32 * s32, axis=0) / HIDDEN  # masked lanes hold 0 and add nothing
    normed = (s32 * tl.math.rsqrt(variance + eps)).to(s.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * HIDDEN + cols, out.to(s.dtype), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, s) with s = x + residual (x itself when residual is None) and out = weight * RMSNorm(s).

    x: [num_tokens, hidden], any row stride; residual: like x or None; weight: [hidden]. Nothing is written in
    place: out, and s when a residual is given, are new contiguous tensors. See rms_norm_ref for the roundings.
    """
    _check(x, weight, residual)
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    s = x if residual is None else torch.empty_like(out)
    if num_tokens == 0:
        return out, s
    block = next_power_of_2(hidden)
    launch_cached(_rms_norm_kernel, (num_tokens,),
        x, x.stride(0), x if residual is None else residual, 0 if residual is None else residual.stride(0),
        weight, out, s, eps,
        HIDDEN=hidden, HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=_num_warps(block),
    )  # fmt: skip
    return out, s


def _num_warps(block: int) -> int:
    # About 16 elements per thread (a warp per 512): one warp for small rows, 16 warps for hidden 8192.
    return min(16, max(1, block // 512))


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [num_tokens, hidden], got shape {tuple(x.shape)}")
    if x.dtype not in NORM_DTYPES:
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError(f"x needs unit stride along hidden, got strides {x.stride()}")
    hidden = x.shape[1]
    if weight.shape != (hidden,) or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous [{hidden}], got shape {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must be x's dtype {x.dtype}")
    if residual is None:
        return
    if residual.shape != x.shape or residual.dtype != x.dtype:
        got = f"{residual.dtype} {tuple(residual.shape)}"
        raise ValueError(f"residual must be {x.dtype} {tuple(x.shape)} like x, got {got}")
    if residual.stride(1) != 1:
        raise ValueError(f"residual needs unit stride along hidden, got strides {residual.stride()}")
