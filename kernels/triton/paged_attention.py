"""Paged attention: causal attention of new tokens over pool pages, for any mix of prompts, chunks and decodes.

Sequence i's new tokens are rows q_start[i]:q_start[i+1] of q and the last q_len positions of its seq_len-token
context, whose earlier K/V are already in its pages (a chunk attending to cached tokens; a whole prompt has
q_len == seq_len). Grid: query tiles × head blocks. A tile is up to BLOCK_M new tokens of one sequence
(AttentionMeta.tiles); its program streams the K/V rows of that sequence from position 0 up to its last query,
gathering them from pages through block_tables, with an online softmax (flash attention).

Query heads of one kv head read the same K/V rows (GQA). Decode-shaped tiles (short segments) are bound by those
reads, so one program takes all the query heads of a kv head, HEADS of them, as BLOCK_M × HEADS rows of its dots,
and reads each K/V row once instead of once per query head. Prompt-sized tiles would need too many rows for
that; they take one head each, and on a GQA model heads run fastest in the grid, so that the heads of one kv
head run side by side and find its K/V rows in L2. An MHA model has no rows to share between heads: its grid keeps
tiles fastest, so that the tiles of one prompt, which read the same prefix, run side by side.

    q, out: [num_tokens, heads, head_dim]      kv_layer: [num_pages, 2, block_size, kv_heads, head_dim]
    query row r of sequence i sits at position seq_len - q_len + (r - q_start[i]) and sees keys 0 .. position

Steps that only decode use the split-sequence kernel of paged_decode.py instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slora.kernels.metadata import SHORT_SEGMENT, AttentionMeta
from slora.kernels.triton.launch import LOG2E, dot_precision, next_power_of_2
from slora.kernels.triton.relaunch import Relaunch


@dataclass(frozen=True)
class AttentionConfig:
    block_m: int  # query tokens per tile
    block_n: int  # context tokens per inner step
    num_warps: int
    num_stages: int


# By (element size, short queries): steps whose longest chunk is short use small query tiles.
CONFIGS = {
    (2, False): AttentionConfig(64, 64, 4, 2),
    (2, True): AttentionConfig(16, 64, 4, 2),
    (4, False): AttentionConfig(64, 32, 4, 2),
    (4, True): AttentionConfig(16, 32, 4, 2),
}


# The most rows (query tokens × query heads) of a program's dots when it takes a kv head's query heads together.
MAX_PACKED_ROWS = 128


def attention_config(element_size: int, max_q_len: int) -> AttentionConfig:
    return CONFIGS[(element_size, max_q_len <= SHORT_SEGMENT)]


def heads_per_program(block_m: int, group: int) -> int:
    """Query heads one program attends: the kv head's whole group when the packed rows fit, else one."""
    return group if block_m * next_power_of_2(group) <= MAX_PACKED_ROWS else 1


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, heads, head_dim]
    stride_q_tok,
    stride_q_head,
    kv_ptr,  # one pool layer viewed as [num_pages, 2, block_size, kv_heads, head_dim]
    stride_page,
    stride_kv,
    stride_slot,
    stride_head,
    out_ptr,  # [num_tokens, heads, head_dim] (written)
    stride_o_tok,
    stride_o_head,
    tiles_ptr,  # int32 [num_tiles, 4]: (sequence, first query row, its last row + 1, sequence)
    q_start_ptr,  # int32 [num_seqs + 1]
    seq_lens_ptr,  # int32 [num_seqs]
    block_tables_ptr,  # int32 [num_seqs, max_blocks]
    stride_bt,
    qk_scale,  # softmax scale × log2(e)
    GROUP: tl.constexpr,  # query heads per kv head
    HEADS: tl.constexpr,  # query heads of one program: 1 or GROUP
    HEADS_P: tl.constexpr,  # HEADS padded to a power of two
    HEADS_FIRST: tl.constexpr,  # grid axis 0 is the head block (else the query tile)
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    if HEADS_FIRST:
        head0 = tl.program_id(0) * HEADS
        tile = tl.program_id(1)
    else:
        tile = tl.program_id(0)
        head0 = tl.program_id(1) * HEADS
    kv_head = head0 // GROUP
    seq = tl.load(tiles_ptr + 4 * tile)
    first = tl.load(tiles_ptr + 4 * tile + 1)
    q_end = tl.load(tiles_ptr + 4 * tile + 2)
    q_begin = tl.load(q_start_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx0 = seq_len - (q_end - q_begin)  # position of the sequence's first new token

    # Row r of the dots is query token r // HEADS_P of the tile under query head head0 + r % HEADS_P.
    r = tl.arange(0, BLOCK_M * HEADS_P)
    rows = first + r // HEADS_P
    heads = head0 + r % HEADS_P
    row_mask = (rows < q_end) & (r % HEADS_P < HEADS)
    pos = ctx0 + rows - q_begin
    kv_end = tl.minimum(seq_len, ctx0 + first - q_begin + BLOCK_M)  # past the tile's last query: all masked
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_mask = row_mask[:, None] & d_mask[None, :]
    q_offs = rows.to(tl.int64)[:, None] * stride_q_tok + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)

    m_i = tl.full((BLOCK_M * HEADS_P,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M * HEADS_P,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M * HEADS_P, BLOCK_D), dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(0, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        page = tl.load(table + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        base = page * stride_page + (n % PAGE_SIZE) * stride_slot + kv_head * stride_head
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(kv_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(kv_ptr + stride_kv + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        # Key 0 is visible to every row, so no row of the first step is fully masked (no NaN).
        s = tl.where((n[None, :] <= pos[:, None]) & n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_offs = rows.to(tl.int64)[:, None] * stride_o_tok + heads[:, None] * stride_o_head + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """Causal attention of every new token over its sequence's context (cached + new); q: [num_tokens, heads, d].

    The launches are built by the step's first layer and reused by the others (kernels/triton/relaunch.py)."""
    check_attention_args(q, kv_layer, meta)
    out = torch.empty_like(q)
    key = ("paged_attention", q.shape, q.stride(), kv_layer.shape, kv_layer.stride(), q.dtype, scale, config)
    launches = meta.launches.get(key)
    if launches is None:
        launches = meta.launches[key] = _launches(q, kv_layer, out, meta, scale, config)
    for launch in launches:
        launch(q, kv_layer, out)
    return out


def _launches(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    out: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    config: AttentionConfig | None,
) -> list[Relaunch]:
    """One launch per group of sequences (decodes apart from prompts, each with its own tile shape)."""
    _, heads, head_dim = q.shape
    kv_heads, page_size = kv_layer.shape[3], kv_layer.shape[2]
    per_kv_head = heads // kv_heads  # query heads per kv head (GQA's group)
    launches = []
    for group in meta.groups(split=config is None):
        cfg = config or attention_config(q.element_size(), group.max_segment_len)
        tiles = group.tiles(cfg.block_m)
        if tiles.shape[0] == 0:
            continue
        per_program = heads_per_program(cfg.block_m, per_kv_head)
        heads_p = next_power_of_2(per_program)
        args = dict(
            q_ptr=q, stride_q_tok=q.stride(0), stride_q_head=q.stride(1),
            kv_ptr=kv_layer, stride_page=kv_layer.stride(0), stride_kv=kv_layer.stride(1),
            stride_slot=kv_layer.stride(2), stride_head=kv_layer.stride(3),
            out_ptr=out, stride_o_tok=out.stride(0), stride_o_head=out.stride(1),
            tiles_ptr=tiles, q_start_ptr=meta.q_start, seq_lens_ptr=meta.seq_lens,
            block_tables_ptr=meta.block_tables, stride_bt=meta.block_tables.stride(0),
            qk_scale=scale * LOG2E,
            GROUP=per_kv_head, HEADS=per_program, HEADS_P=heads_p, HEADS_FIRST=per_kv_head > 1,
            HEAD_DIM=head_dim, PAGE_SIZE=page_size,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=next_power_of_2(head_dim),
            DOT_PRECISION=dot_precision(q.dtype),
        )  # fmt: skip
        # rows past a prompt tile's (64) get more warps, so that the accumulator stays in registers
        options = dict(num_warps=max(cfg.num_warps, cfg.block_m * heads_p // 16), num_stages=cfg.num_stages)
        blocks, num_tiles = heads // per_program, int(tiles.shape[0])
        grid = (blocks, num_tiles) if per_kv_head > 1 else (num_tiles, blocks)
        launches.append(Relaunch(_paged_attention_kernel, grid, args, options, ("q_ptr", "kv_ptr", "out_ptr")))
    return launches


def check_attention_args(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMeta) -> None:
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"q must be [num_tokens, heads, head_dim] with unit stride on head_dim, got {tuple(q.shape)}")
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2 or kv_layer.shape[4] != q.shape[2] or kv_layer.stride(4) != 1:
        raise ValueError(f"kv_layer {tuple(kv_layer.shape)} is not [num_pages, 2, block_size, kv_heads, {q.shape[2]}]")
    if q.shape[1] % kv_layer.shape[3] != 0:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {kv_layer.shape[3]} kv heads")
    if q.dtype != kv_layer.dtype:
        raise ValueError(f"q ({q.dtype}) must have the pool's dtype {kv_layer.dtype}")
    if kv_layer.shape[2] != meta.block_size:
        raise ValueError(f"kv_layer has {kv_layer.shape[2]} tokens per page, the metadata {meta.block_size}")
    if q.shape[0] != meta.q_start_host[-1]:
        raise ValueError(f"q has {q.shape[0]} tokens, the metadata {meta.q_start_host[-1]}")
