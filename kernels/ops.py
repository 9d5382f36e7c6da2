"""The attention, LoRA and fused elementwise operations the model calls, behind one interface.

`TorchOps` is the plain-torch reference (any device). Triton-language kernels implement the same methods
in kernels/triton/ops.py, and S-LoRA's padded-bmm LoRA baseline in kernels/reference/lora_padded.py;
`make_ops` picks one.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn.functional as F

from slora.kernels.metadata import AttentionMeta, LoraMeta
from slora.kernels.reference.activation import silu_mul_ref
from slora.kernels.reference.attention import paged_attention_ref, write_kv_ref
from slora.kernels.reference.lora import lora_ref
from slora.kernels.reference.lora_padded import lora_padded_bmm
from slora.kernels.reference.norm import rms_norm_ref
from slora.kernels.reference.rotary import apply_rotary_ref
from slora.kernels.settings import KernelSettings

logger = logging.getLogger(__name__)


class Ops(Protocol):
    name: str

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x·Wᵀ + bias, as F.linear (the Triton ops take a GEMM of their own for steps of few rows)."""
        ...

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMeta) -> None: ...

    def attention(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMeta, scale: float) -> torch.Tensor: ...

    def lora(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        flat_layer: torch.Tensor,
        meta: LoraMeta,
        modules: tuple[int, ...],
        out_offsets: tuple[int, ...],
        out_widths: tuple[int, ...],
    ) -> None: ...

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual) · weight, x + residual): the residual add fused with the norm
        (kernels/triton/norm.py)."""
        ...

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """Rotate q [T, heads, d] and k [T, kv_heads, d] in place by their positions' rows of the cos/sin tables."""
        ...

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        """SiLU(gate) · up of the fused gate/up output [gate | up] (kernels/triton/activation.py)."""
        ...

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
        """rotary(q, k, ...) then write_kv(k, v, kv_layer, meta); the Triton ops do both in one launch."""
        ...


class TorchOps:
    name = "torch"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm_ref(x, weight, eps, residual)

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        rotated_q, rotated_k = apply_rotary_ref(q, k, positions, cos, sin)
        q.copy_(rotated_q)
        k.copy_(rotated_k)

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        return silu_mul_ref(gate_up, inter)

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
        self.rotary(q, k, positions, cos, sin)
        self.write_kv(k, v, kv_layer, meta)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMeta) -> None:
        write_kv_ref(k, v, kv_layer, meta.slot_mapping)

    def attention(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMeta, scale: float) -> torch.Tensor:
        return paged_attention_ref(q, kv_layer, meta, scale)

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
        lora_ref(y, x, flat_layer, meta, modules, out_offsets, out_widths)


class PaddedLora:
    """S-LoRA's padded-bmm LoRA baseline (kernels/reference/lora_padded.py), mixed into an Ops class for everything
    else."""

    name = "bmm"

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
        lora_padded_bmm(y, x, flat_layer, meta, modules, out_offsets, out_widths)


class PaddedBmmOps(PaddedLora, TorchOps):
    """The padded-bmm LoRA with the torch references for the rest (CPU, or CUDA without triton)."""


KERNELS_EXTRA = "pip install 'slora-triton[kernels]'"  # what installs the triton package


def make_ops(backend: str, device: torch.device, settings: KernelSettings) -> Ops:
    """'torch', 'triton', 'auto' (Triton on CUDA when importable, else torch), or 'bmm': S-LoRA's padded LoRA
    baseline with the Triton kernels for everything else on CUDA (so that only the LoRA differs from 'triton'),
    with the torch references elsewhere. The Triton-language kernels are imported here, only when picked: the torch
    path runs without the triton package. `settings` tune the Triton kernels; the torch references ignore them."""
    if backend == "bmm":
        if device.type != "cuda":
            return PaddedBmmOps()
        try:
            from slora.kernels.triton.ops import TritonPaddedBmmOps
        except ImportError as exc:
            logger.warning("kernel_backend='bmm': no Triton kernels (%s), the torch references run the rest", exc)
            return PaddedBmmOps()
        return TritonPaddedBmmOps(settings)
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return TorchOps()
    try:
        from slora.kernels.triton.ops import TritonOps
    except ImportError as exc:
        if backend == "triton":
            raise ValueError(f"kernel_backend='triton' needs the triton package ({exc}): {KERNELS_EXTRA}") from exc
        logger.warning("kernel_backend='auto' on %s: no Triton kernels (%s), running the torch references; "
                       "%s for the Triton kernels", device, exc, KERNELS_EXTRA)  # fmt: skip
        return TorchOps()
    return TritonOps(settings)
