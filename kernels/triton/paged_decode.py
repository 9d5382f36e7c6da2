"""Decode attention over pool pages (flash-decoding): one query token per sequence, many lengths in one batch.

Grid: (sequence, kv head, partition). One program attends the GROUP query heads that share a kv head (GQA; the
group is padded to 16 rows for the tensor-core dot) to one partition of the sequence's context, reading each K/V
row once from its page (block_tables), with an online softmax. When a sequence is split into several partitions,
each writes its running max, sum and unnormalized output, and decode_reduce.py merges them; a batch whose
sequences fit in one partition writes the output directly. Partitions are sized so that short batches of long
sequences still fill the GPU, and partitions past a sequence's end exit at once.

    q:   [num_seqs, heads, head_dim]           kv_layer: [num_pages, 2, block_size, kv_heads, head_dim]
    out: [num_seqs, heads, head_dim]           token n of sequence i: page block_tables[i, n // block_size],
                                               slot n % block_size
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slora.kernels.metadata import AttentionMeta
from slora.kernels.triton.decode_reduce import decode_reduce
from slora.kernels.triton.launch import LOG2E, cdiv, dot_precision, next_power_of_2, num_sms
from slora.kernels.triton.paged_attention import check_attention_args
from slora.kernels.triton.relaunch import launch_cached


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # context tokens per inner step
    min_partition: int  # never split a sequence into pieces shorter than this
    max_partitions: int  # nor into more pieces than this (the reduce step holds them all)
    programs_per_sm: int  # split until about this many programs per SM run
    num_warps: int
    num_stages: int


CONFIGS = {2: DecodeConfig(64, 256, 64, 8, 4, 3), 4: DecodeConfig(32, 256, 64, 8, 4, 2)}  # by element size


@triton.jit(do_not_specialize=["stride_bt", "max_parts"])
def _paged_decode_kernel(
    q_ptr,  # [num_tokens, heads, head_dim]: sequence i's query is row q_start[i]
    stride_q_tok,
    stride_q_head,
    kv_ptr,  # one pool layer viewed as [num_pages, 2, block_size, kv_heads, head_dim]
    stride_page,
    stride_kv,
    stride_slot,
    stride_head,
    q_start_ptr,  # int32 [num_seqs + 1]
    seq_lens_ptr,  # int32 [num_seqs]: context length, the new token included
    block_tables_ptr,  # int32 [num_seqs, max_blocks]
    stride_bt,
    out_ptr,  # [num_tokens, heads, head_dim]: written when SPLIT is false
    stride_o_tok,
    stride_o_head,
    part_m_ptr,  # float32 [num_seqs, heads, max_parts]: running max (log2 units), when SPLIT
    part_l_ptr,  # float32 [num_seqs, heads, max_parts]: running sum of exp2
    part_acc_ptr,  # float32 [num_seqs, heads, max_parts, head_dim]: unnormalized output
    max_parts,
    partition_size,  # context tokens per partition, a multiple of BLOCK_N
    qk_scale,  # softmax scale × log2(e)
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two >= 16
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * partition_size
    if start < seq_len:
        end = tl.minimum(seq_len, start + partition_size)
        row = tl.load(q_start_ptr + seq).to(tl.int64)
        g = tl.arange(0, BLOCK_G)
        heads = kv_head * GROUP + g
        d = tl.arange(0, BLOCK_D)
        q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
        q = tl.load(q_ptr + row * stride_q_tok + heads[:, None] * stride_q_head + d[None, :], mask=q_mask, other=0.0)

        m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < end
            page = tl.load(table + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
            base = page * stride_page + (n % PAGE_SIZE) * stride_slot + kv_head * stride_head
            kv_mask = n_mask[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(kv_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            v = tl.load(kv_ptr + stride_kv + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
            m_i = m_new

        head_mask = g < GROUP
        if SPLIT:
            part_row = (seq * tl.num_programs(1) * GROUP + heads).to(tl.int64) * max_parts + part
            tl.store(part_m_ptr + part_row, m_i, mask=head_mask)
            tl.store(part_l_ptr + part_row, l_i, mask=head_mask)
            tl.store(part_acc_ptr + part_row[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask)
        else:
            out = acc / l_i[:, None]
            o_ptrs = out_ptr + row * stride_o_tok + heads[:, None] * stride_o_head + d[None, :]
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Attention of each sequence's one new token over its context; q: [num_seqs, heads, head_dim]."""
    check_attention_args(q, kv_layer, meta)
    num_tokens, heads, head_dim = q.shape
    kv_heads, page_size = kv_layer.shape[3], kv_layer.shape[2]
    group = heads // kv_heads
    cfg = config or CONFIGS[q.element_size()]
    parts, partition = _partitions(meta.num_seqs * kv_heads, meta.max_seq_len, cfg, q.device)
    out = torch.empty_like(q)
    split = parts > 1
    part_m = part_l = part_acc = out  # unused placeholders when not split
    if split:
        part_m = torch.empty((meta.num_seqs, heads, parts), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((meta.num_seqs, heads, parts, head_dim), dtype=torch.float32, device=q.device)
    grid = (meta.num_seqs, kv_heads, parts)
    launch_cached(_paged_decode_kernel, grid,
        q, q.stride(0), q.stride(1),
        kv_layer, kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        meta.q_start, meta.seq_lens, meta.block_tables, meta.block_tables.stride(0),
        out, out.stride(0), out.stride(1), part_m, part_l, part_acc,
        parts, partition, scale * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, SPLIT=split,
        BLOCK_G=max(16, next_power_of_2(group)), BLOCK_D=next_power_of_2(head_dim),
        BLOCK_N=cfg.block_n, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split:
        decode_reduce(part_m, part_l, part_acc, out, meta, partition)
    return out


def _partitions(programs: int, max_seq_len: int, cfg: DecodeConfig, device: torch.device) -> tuple[int, int]:
    """(partitions per sequence, tokens per partition): enough programs to fill the GPU, pieces not too short."""
    target = cfg.programs_per_sm * num_sms(device)
    parts = min(cdiv(target, programs), cdiv(max_seq_len, cfg.min_partition), cfg.max_partitions)
    parts = max(1, parts)
    partition = cdiv(cdiv(max_seq_len, parts), cfg.block_n) * cfg.block_n
    return cdiv(max_seq_len, partition), partition
