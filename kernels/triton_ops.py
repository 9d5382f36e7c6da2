"""The Ops interface on Triton-language kernels: paged K/V writes, paged attention, heterogeneous LoRA, and the
fused elementwise work (RMSNorm with the residual add, RoPE of q and k in place).

Attention: steps that only decode use flash-decoding (paged_decode.py, split along the sequence); any step with a
prompt or a chunk uses the general kernel (paged_attention.py), which serves its decodes too. LoRA: one shrink
and one expand launch per run of consecutive modules (q, k, v or gate, up share x), whatever the mix of adapters
and ranks; the kernels pick decode- or prefill-shaped tiles from the step's longest segment.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from slora.kernels.kv_write import write_kv
from slora.kernels.lora_expand import lora_expand
from slora.kernels.lora_shrink import lora_shrink
from slora.kernels.metadata import AttentionMeta, LoraMeta
from slora.kernels.norm import rms_norm
from slora.kernels.ops import PaddedLora
from slora.kernels.paged_attention import paged_attention
from slora.kernels.paged_decode import paged_decode_attention
from slora.kernels.rotary import apply_rotary_

MAX_FUSED = 3  # modules the expand kernel adds in one launch


class TritonOps:
    name = "triton"

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, weight, eps, residual)

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        apply_rotary_(q, k, positions, cos, sin)

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
        for first, offsets, widths in consecutive_runs(modules, out_offsets, out_widths):
            if meta.fused_rank(first, len(widths)) == 0:
                continue  # no adapter of the step targets these modules
            for group in meta.groups():  # decodes apart from prompts: each gets its own tile shape
                v = lora_shrink(x, flat_layer, meta, first, len(widths), group)
                lora_expand(y, v, flat_layer, meta, first, offsets, widths, group)


def consecutive_runs(
    modules: tuple[int, ...], out_offsets: tuple[int, ...], out_widths: tuple[int, ...]
) -> Iterator[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(first module, offsets, widths) of each run of up to MAX_FUSED consecutive modules, in order."""
    start = 0
    for i in range(1, len(modules) + 1):
        run_ends = i == len(modules) or modules[i] != modules[i - 1] + 1 or i - start == MAX_FUSED
        if run_ends:
            yield modules[start], tuple(out_offsets[start:i]), tuple(out_widths[start:i])
            start = i


class TritonPaddedBmmOps(PaddedLora, TritonOps):
    """kernel_backend='bmm' on CUDA: the padded-bmm LoRA baseline, every other op the Triton kernels'."""
