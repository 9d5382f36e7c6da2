"""The Ops interface on Triton-language kernels: paged K/V writes, paged attention, heterogeneous LoRA, and the
fused elementwise work (RMSNorm with the residual add, RoPE of q and k in place, SiLU · up), and the projections
of steps of few rows (kernels/triton/projection.py).

Attention: steps that only decode use flash-decoding (paged_decode.py, split along the sequence); any step with a
prompt or a chunk uses the general kernel (paged_attention.py), which serves its decodes too. LoRA: one shrink
and one expand launch per run of consecutive modules (q, k, v or gate, up share x), whatever the mix of adapters
and ranks, decodes and prompts together; decode-shaped tiles for any step with decodes, prefill-shaped ones for
steps of prompts only (metadata.SegmentGroup.tile_len).
"""

from __future__ import annotations

import dataclasses

import torch

from slora.kernels.metadata import AttentionMeta, LoraMeta
from slora.kernels.ops import PaddedLora
from slora.kernels.settings import DEFAULT_SETTINGS, KernelSettings
from slora.kernels.triton.activation import silu_mul
from slora.kernels.triton.kv_write import write_kv
from slora.kernels.triton.lora_call import lora_calls
from slora.kernels.triton.norm import rms_norm
from slora.kernels.triton.paged_attention import paged_attention
from slora.kernels.triton.paged_decode import paged_decode_attention
from slora.kernels.triton.projection import Projections
from slora.kernels.triton.rotary import apply_rotary_, apply_rotary_write_kv_


class TritonOps:
    name = "triton"

    def __init__(self, settings: KernelSettings = DEFAULT_SETTINGS) -> None:
        self.settings = settings
        self._settings_key = dataclasses.astuple(settings)  # in the launches' key: a tuple hashes faster
        self.projections = Projections(settings)  # the base projections (the Triton GEMM of small steps, else cuBLAS)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.projections(x, weight, bias)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, weight, eps, residual)

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        apply_rotary_(q, k, positions, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        return silu_mul(gate_up, inter)

    def rotary_write_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMeta,
    ) -> None:
        apply_rotary_write_kv_(q, k, v, positions, cos, sin, kv_layer, meta.slot_mapping)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMeta) -> None:
        write_kv(k, v, kv_layer, meta.slot_mapping)

    def attention(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMeta, scale: float) -> torch.Tensor:
        if meta.decode_only:
            return paged_decode_attention(q, kv_layer, meta, scale)
        return paged_attention(q, kv_layer, meta, scale)

    def lora(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        flat_layer: torch.Tensor,
        meta: LoraMeta,
        modules: tuple[int, ...],
        out_offsets: tuple[int, ...],
        out_widths: tuple[int, ...],
    ) -> None:
        behind_gemm = self.projections.wrote_last(y)  # the shrink may then be launched with PDL (kernels/triton/pdl.py)
        # the settings too: ops of other settings (benchmarks comparing them) may run the same step's metadata
        key = (modules, out_offsets, out_widths, x.shape, x.stride(0), y.shape, y.stride(0), x.dtype,
               self._settings_key, behind_gemm)  # fmt: skip
        calls = meta.launches.get(key)
        if calls is None:
            calls = meta.launches[key] = lora_calls(
                y, x, flat_layer, meta, modules, out_offsets, out_widths, self.settings, pdl_shrink=behind_gemm
            )
        for call in calls:
            call(y, x, flat_layer)


class TritonPaddedBmmOps(PaddedLora, TritonOps):
    """kernel_backend='bmm' on CUDA: the padded-bmm LoRA baseline, every other op the Triton kernels'."""
