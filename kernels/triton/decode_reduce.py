"""The reduce step of split decode attention: merge each sequence's partition results into its output.

Partition p of a sequence left m_p (running max of its scores, log2 units), l_p (sum of exp2(score - m_p)) and
acc_p (Σ exp2(score - m_p) · v). With M = max_p m_p and w_p = exp2(m_p - M):

    out = Σ_p w_p · acc_p / Σ_p w_p · l_p

Grid: (sequence, query head). Only the sequence's own cdiv(seq_len, partition_size) partitions are read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slora.kernels.metadata import AttentionMeta
from slora.kernels.triton.launch import next_power_of_2
from slora.kernels.triton.relaunch import launch_cached

# Partition lanes of the reduce: one compiled variant covers up to this many partitions per sequence (masked
# lanes cost nothing worth counting), instead of one variant per power of two as contexts grow.
MIN_BLOCK_P = 16


@triton.jit(do_not_specialize=["max_parts"])
def _decode_reduce_kernel(
    part_m_ptr,  # float32 [num_seqs, heads, max_parts]
    part_l_ptr,  # float32 [num_seqs, heads, max_parts]
    part_acc_ptr,  # float32 [num_seqs, heads, max_parts, head_dim]
    out_ptr,  # [num_tokens, heads, head_dim]: sequence i's row is q_start[i]
    stride_o_tok,
    stride_o_head,
    q_start_ptr,  # int32 [num_seqs + 1]
    seq_lens_ptr,  # int32 [num_seqs]
    max_parts,
    partition_size,
    HEAD_DIM: tl.constexpr,
    BLOCK_P: tl.constexpr,  # next power of two >= max_parts
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_parts = tl.cdiv(seq_len, partition_size)
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    p_mask = p < num_parts
    rows = (seq * tl.num_programs(1) + head).to(tl.int64) * max_parts + p
    m = tl.load(part_m_ptr + rows, mask=p_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + rows, mask=p_mask, other=0.0)  # noqa: E741
    acc = tl.load(part_acc_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=p_mask[:, None] & (d < HEAD_DIM)[None, :])
    w = tl.where(p_mask, tl.exp2(m - tl.max(m, 0)), 0.0)
    out = tl.sum(w[:, None] * acc, 0) / tl.sum(w * l, 0)
    row = tl.load(q_start_ptr + seq).to(tl.int64)
    o_ptrs = out_ptr + row * stride_o_tok + head * stride_o_head + d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def decode_reduce(
    part_m: torch.Tensor,
    part_l: torch.Tensor,
    part_acc: torch.Tensor,
    out: torch.Tensor,
    meta: AttentionMeta,
    partition_size: int,
) -> None:
    """Write out[q_start[i], h] from the partition results of sequence i, query head h (see top)."""
    num_seqs, heads, max_parts, head_dim = part_acc.shape
    if part_m.shape != (num_seqs, heads, max_parts) or part_l.shape != part_m.shape:
        raise ValueError(f"partition maxima {tuple(part_m.shape)} and sums {tuple(part_l.shape)} do not match")
    if not (part_m.is_contiguous() and part_l.is_contiguous() and part_acc.is_contiguous()):
        raise ValueError("partition buffers must be contiguous")
    if out.dim() != 3 or out.shape[1:] != (heads, head_dim) or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} is not [num_tokens, {heads}, {head_dim}] with unit last stride")
    launch_cached(_decode_reduce_kernel, (num_seqs, heads),
        part_m, part_l, part_acc, out, out.stride(0), out.stride(1), meta.q_start, meta.seq_lens,
        max_parts, partition_size,
        HEAD_DIM=head_dim, BLOCK_P=max(MIN_BLOCK_P, next_power_of_2(max_parts)),
        BLOCK_D=next_power_of_2(head_dim),
        num_warps=4,
    )  # fmt: skip
