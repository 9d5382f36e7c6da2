"""Plain-torch heterogeneous LoRA over the unified pool (gather rows, then matmul), the kernels' reference.

For every segment of tokens that share an adapter and every requested projection m that the adapter targets:

    y[tokens, out_offset_m : out_offset_m + out_m] += ((x[tokens] @ A_mᵀ) @ B_mᵀ) * scale_m

with A_m ([rank, in]) and B_mᵀ ([rank, out]) gathered row by row from the pool. Tokens of the base model and
projections an adapter does not target are left untouched.
"""

from __future__ import annotations

import torch

from slora.kernels.metadata import LoraMeta


def gather_rows(flat_layer: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
    """[len(rows), width]: row i is flat_layer[rows[i] : rows[i] + width]."""
    index = rows[:, None] + torch.arange(width, device=flat_layer.device)
    return flat_layer[index]


def lora_ref(
    y: torch.Tensor,
    x: torch.Tensor,
    flat_layer: torch.Tensor,
    meta: LoraMeta,
    modules: tuple[int, ...],
    out_offsets: tuple[int, ...],
    out_widths: tuple[int, ...],
) -> None:
    """Add each token's LoRA delta for `modules` into `y` in place.

    x: [num_tokens, in]; y: [num_tokens, sum(out_widths) or more]; flat_layer: one pool layer, flattened.
    """
    in_features = x.shape[1]
    for g, a in enumerate(meta.seg_adapter_host):
        start, end = meta.seg_start_host[g], meta.seg_start_host[g + 1]
        for m, offset, width in zip(modules, out_offsets, out_widths):
            rank = meta.ranks_host[a][m]
            if rank == 0:
                continue
            first = meta.row_start_host[a][m]
            lora_a = gather_rows(flat_layer, meta.a_rows[first : first + rank], in_features)  # [rank, in]
            lora_b = gather_rows(flat_layer, meta.b_rows[first : first + rank], width)  # [rank, out]
            delta = (x[start:end] @ lora_a.t()) @ lora_b * meta.scales_host[a][m]
            y[start:end, offset : offset + width] += delta
