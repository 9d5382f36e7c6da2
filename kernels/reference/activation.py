"""Plain-torch SwiGLU activation: the reference for kernels/triton/activation.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """SiLU(gate) · up for gate_up = [gate | up] ([num_tokens, 2 · inter]), as Hugging Face Llama's MLP computes it:
    SiLU rounded to the model dtype, then the product rounded again."""
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
