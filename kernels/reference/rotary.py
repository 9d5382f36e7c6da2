"""Plain-torch rotary position embedding of q and k: the reference for kernels/triton/rotary.py."""

from __future__ import annotations

import torch


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q: [T, heads, head_dim] and k: [T, kv_heads, head_dim]; the inputs are left as they are.

    cos, sin: [max_positions, head_dim] tables (backend/model/rope.py's RotaryTable); positions: int64 [T]. The formula
    and its roundings (in the tensors' dtype) are Hugging Face Llama's: x * cos + rotate_half(x) * sin.
    """
    cos_t = cos[positions].unsqueeze(1)  # [T, 1, head_dim], broadcast over heads
    sin_t = sin[positions].unsqueeze(1)
    return _rotate(q, cos_t, sin_t), _rotate(k, cos_t, sin_t)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
