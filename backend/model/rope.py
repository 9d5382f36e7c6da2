"""Rotary position embedding tables (default, linear and Llama-3 scaling), as Hugging Face computes them."""

from __future__ import annotations

import math

import torch

from slora.backend.model.spec import RopeSpec


def inverse_frequencies(spec: RopeSpec, head_dim: int) -> torch.Tensor:
    """inv_freq: [head_dim // 2] float32, scaled as the rope type asks."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (spec.theta**exponents)
    if spec.rope_type == "linear":
        return inv_freq / spec.factor
    if spec.rope_type == "llama3":
        return _llama3_scaling(inv_freq, spec)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    old_len = spec.original_max_position_embeddings
    low_freq_wavelen = old_len / spec.low_freq_factor
    high_freq_wavelen = old_len / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / spec.factor, inv_freq)
    smooth = (old_len / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTable:
    """cos/sin for every position up to `max_positions`, in the model dtype, on the model device."""

    def __init__(
        self, spec: RopeSpec, head_dim: int, max_positions: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        inv_freq = inverse_frequencies(spec, head_dim)
        positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # cos, sin: [max_positions, head_dim]
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)
