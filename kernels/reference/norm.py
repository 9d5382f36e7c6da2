"""Plain-torch RMSNorm with the residual add before it: the reference for kernels/triton/norm.py."""

from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, s): s = x + residual (or x), out = Hugging Face Llama's RMSNorm of s, with its roundings.

    x, residual: [num_tokens, hidden]; weight: [hidden]. The statistics are float32; the normalized s is rounded to
    x's dtype before the weight multiplies it, as LlamaRMSNorm does.
    """
    s = x if residual is None else x + residual
    s32 = s.to(torch.float32)
    s32 = s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * s32.to(x.dtype), s
