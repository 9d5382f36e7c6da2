"""Plain-torch paged attention over the unified pool: the reference for the Triton kernels and the CPU path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slora.kernels.metadata import AttentionMeta


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each new token's K and V in its pool slot.

    k, v: [num_tokens, kv_heads, head_dim]; kv_layer: [num_pages, 2, block_size, kv_heads, head_dim] (written).
    """
    num_pages, _, block_size = kv_layer.shape[:3]
    pages = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    kv_layer[pages, 0, offsets] = k
    kv_layer[pages, 1, offsets] = v


def gather_kv(kv_layer: torch.Tensor, pages: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of one sequence: each [length, kv_heads, head_dim], read from its pages in order."""
    block = kv_layer[pages]  # [n_pages, 2, block_size, kv_heads, head_dim]
    k = block[:, 0].flatten(0, 1)[:length]
    v = block[:, 1].flatten(0, 1)[:length]
    return k, v


def paged_attention_ref(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMeta, scale: float | None = None
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole context (cached + new), GQA-aware.

    q: [num_tokens, heads, head_dim] → out: [num_tokens, heads, head_dim].
    """
    out = torch.empty_like(q)
    block_size = meta.block_size
    for i in range(meta.num_seqs):
        start, end = meta.q_start_host[i], meta.q_start_host[i + 1]
        seq_len = meta.seq_lens_host[i]
        pages = meta.block_tables_host[i][: -(-seq_len // block_size)]
        k, v = gather_kv(kv_layer, pages, seq_len)
        out[start:end] = _attend(q[start:end], k, v, scale)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    # q: [n, heads, d]; k, v: [ctx, kv_heads, d]; the n queries are the last n positions of the context.
    n, heads, _ = q.shape
    ctx, kv_heads, _ = k.shape
    group = heads // kv_heads
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)  # [1, heads, ctx, d]
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
    if n == ctx:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=n > 1, scale=scale)
    else:
        mask = None
        if n > 1:
            q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.squeeze(0).transpose(0, 1)
