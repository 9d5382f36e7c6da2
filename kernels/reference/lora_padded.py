"""S-LoRA's "bmm" baseline: pad every active adapter to the step's largest rank, then batched matmuls in torch.

For each module, the adapters' A rows and Bᵀ rows are gathered from the pool into dense stacks padded with zero
rows up to the largest rank R of any adapter of the step, and every adapter token multiplies its own adapter's
stack (gathered per token, as a batched matmul does):

    v_t = x_t · A_pad[a(t)]ᵀ    ([1, R])        y_t += v_t · Bᵀ_pad[a(t)] · scale[a(t)]

FLOPs and bytes grow with R for every adapter, whatever its own rank: this is what the Triton kernels must beat.
It is exact (zero rows add nothing), so it also serves as a second reference. kernels/ops.PaddedBmmOps pairs it
with the torch attention.
"""

from __future__ import annotations

import torch

from slora.kernels.metadata import LoraMeta

GATHER_BYTES = 256 << 20  # at most this much of per-token padded weights is materialized at once


def padded_rows(
    flat_layer: torch.Tensor, rows: torch.Tensor, meta: LoraMeta, module: int, width: int, max_rank: int
) -> torch.Tensor:
    """[num_adapters, max_rank, width]: each adapter's rows of `module`, zero past its own rank.

    Rows are gathered whole (one index per row, not per element) from a view of the layer in which row i starts
    at element i.
    """
    j = torch.arange(max_rank, device=rows.device)
    index = meta.row_start[:, module, None].long() + j  # [num_adapters, max_rank]
    valid = j < meta.ranks[:, module, None]
    offsets = rows[index.clamp(max=rows.numel() - 1)]  # [num_adapters, max_rank]
    starts = flat_layer.as_strided((flat_layer.numel() - width + 1, width), (1, 1))
    stack = starts.index_select(0, offsets.reshape(-1)).view(*offsets.shape, width)
    return stack * valid[..., None].to(stack.dtype)


def lora_padded_bmm(
    y: torch.Tensor,
    x: torch.Tensor,
    flat_layer: torch.Tensor,
    meta: LoraMeta,
    modules: tuple[int, ...],
    out_offsets: tuple[int, ...],
    out_widths: tuple[int, ...],
) -> None:
    """Add each token's LoRA delta for `modules` into `y` in place (same contract as lora_ref)."""
    if meta.num_segments == 0:
        return
    first, last = meta.seg_start_host[0], meta.seg_start_host[-1]  # adapter tokens come after the base tokens
    adapter = meta.token_adapter[first:last].long()  # [n]
    in_features = x.shape[1]
    for m, offset, width in zip(modules, out_offsets, out_widths):
        max_rank = max(r[m] for r in meta.ranks_host)
        if max_rank == 0:
            continue
        a_pad = padded_rows(flat_layer, meta.a_rows, meta, m, in_features, max_rank)  # [adapters, R, in]
        b_pad = padded_rows(flat_layer, meta.b_rows, meta, m, width, max_rank)  # [adapters, R, out]
        scale = meta.scales[:, m].to(y.dtype)
        chunk = max(1, GATHER_BYTES // (max_rank * (in_features + width) * y.element_size()))
        for start in range(first, last, chunk):
            end = min(last, start + chunk)
            a = adapter[start - first : end - first]
            v = torch.bmm(x[start:end, None, :], a_pad[a].transpose(1, 2))  # [n, 1, R]
            delta = torch.bmm(v, b_pad[a])[:, 0] * scale[a, None]  # [n, out]
            y[start:end, offset : offset + width] += delta
