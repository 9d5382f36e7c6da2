"""Rotary position embedding of q and k in place, in one launch: x' = x * cos[pos] + rotate_half(x) * sin[pos].

rotate_half(x) = cat(-x2, x1) for the halves x1 = x[:D/2], x2 = x[D/2:] (Hugging Face Llama's half split), so
    x1' = x1 * cos[pos, :D/2] - x2 * sin[pos, :D/2]
    x2' = x2 * cos[pos, D/2:] + x1 * sin[pos, D/2:]

Grid (num_tokens, q head blocks + k head blocks): a program reads its token's position and cos/sin rows once and
rotates a block of heads, of q for the first blocks and of k for the rest. The math is float32 and each result is
rounded to the dtype once; the torch reference rounds each product and the sum in the dtype, so for float16 and
bfloat16 the two may differ by an ulp or so of the products (float32: a few ulps at most).

apply_rotary_write_kv_ also stores the rotated k and v in their pool slots from the same programs (WRITE_KV),
which saves kv_write.py's launch: a layer's host time on an eager step is mostly its launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slora.kernels.triton.kv_write import check_kv_write_args
from slora.kernels.triton.launch import cdiv, next_power_of_2
from slora.kernels.triton.relaunch import launch_cached

ROTARY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TILE = 2048  # elements (heads x head_dim) per program, at most


@triton.jit
def _rotate_heads(
    x_ptr,  # this token's row: [heads, head_dim] at stride_head, unit stride along head_dim
    stride_head,
    first_head,
    cos1,  # [1, BLOCK_HALF] float32: cos[pos, :HALF]
    sin1,
    cos2,  # cos[pos, HALF:]
    sin2,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    h = first_head + tl.arange(0, BLOCK_HEADS)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < HEADS) & (d < HALF)
    ptr1 = x_ptr + h * stride_head + d
    x1 = tl.load(ptr1, mask=mask).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask).to(tl.float32)
    out1 = x1 * cos1 - x2 * sin1
    out2 = x2 * cos2 + x1 * sin2
    out1 = out1.to(x_ptr.dtype.element_ty)
    out2 = out2.to(x_ptr.dtype.element_ty)
    tl.store(ptr1, out1, mask=mask)
    tl.store(ptr1 + HALF, out2, mask=mask)
    return out1, out2


@triton.jit
def _rotary_kernel(
    q_ptr,  # [num_tokens, heads, head_dim], unit stride along head_dim (may view the fused qkv output)
    stride_q_tok,
    stride_q_head,
    k_ptr,  # [num_tokens, kv_heads, head_dim], likewise
    stride_k_tok,
    stride_k_head,
    positions_ptr,  # int64 [num_tokens]
    stride_pos,
    cos_ptr,  # [max_positions, head_dim], unit stride along head_dim
    sin_ptr,
    stride_cos,
    stride_sin,
    v_ptr,  # WRITE_KV only: [num_tokens, kv_heads, head_dim], unit stride along head_dim
    stride_v_tok,
    stride_v_head,
    kv_ptr,  # WRITE_KV only: one pool layer viewed as [num_pages, 2, block_size, kv_heads, head_dim]
    stride_page,
    stride_kv,  # K half to V half of a page
    stride_slot,
    stride_kv_head,
    slot_mapping_ptr,  # WRITE_KV only: int64 [num_tokens], page * PAGE_SIZE + offset; negative: no slot
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    Q_BLOCKS: tl.constexpr,  # programs per token for q; those with a higher program_id(1) take k
    BLOCK_Q: tl.constexpr,  # q heads per program
    BLOCK_K: tl.constexpr,  # k heads per program
    BLOCK_HALF: tl.constexpr,  # next power of two >= HALF
    WRITE_KV: tl.constexpr,  # also store the rotated k and v in their pool slots (kv_write.py's job, fused)
    PAGE_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    pos = tl.load(positions_ptr + token * stride_pos)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = d < HALF
    cos_row = cos_ptr + pos * stride_cos + d
    sin_row = sin_ptr + pos * stride_sin + d
    cos1 = tl.load(cos_row, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_row + HALF, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + HALF, mask=mask, other=0.0).to(tl.float32)
    if block < Q_BLOCKS:
        q_row = q_ptr + token * stride_q_tok
        _rotate_heads(q_row, stride_q_head, block * BLOCK_Q, cos1, sin1, cos2, sin2, Q_HEADS, HALF, BLOCK_Q, BLOCK_HALF)
    else:
        k_row = k_ptr + token * stride_k_tok
        first = (block - Q_BLOCKS) * BLOCK_K
        k1, k2 = _rotate_heads(k_row, stride_k_head, first, cos1, sin1, cos2, sin2, K_HEADS, HALF, BLOCK_K, BLOCK_HALF)
        if WRITE_KV:
            slot = tl.load(slot_mapping_ptr + token)
            if slot >= 0:
                h = first + tl.arange(0, BLOCK_K)[:, None]
                heads_mask = (h < K_HEADS) & mask
                dst = kv_ptr + (slot // PAGE_SIZE) * stride_page + (slot % PAGE_SIZE) * stride_slot
                dst += h * stride_kv_head + d
                tl.store(dst, k1, mask=heads_mask)
                tl.store(dst + HALF, k2, mask=heads_mask)
                v_row = v_ptr + token * stride_v_tok + h * stride_v_head + d
                tl.store(dst + stride_kv, tl.load(v_row, mask=heads_mask), mask=heads_mask)
                tl.store(dst + stride_kv + HALF, tl.load(v_row + HALF, mask=heads_mask), mask=heads_mask)


def apply_rotary_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotate q: [T, heads, head_dim] and k: [T, kv_heads, head_dim] in place by their tokens' positions.

    positions: int64 [T], each in [0, max_positions) (not checked: that would cost a device sync); cos, sin:
    [max_positions, head_dim] in q's dtype (backend/model/rope.py's RotaryTable). q and k may be strided views of one
    fused qkv buffer but must not overlap each other. See apply_rotary_ref for the formula.
    """
    _check(q, k, positions, cos, sin)
    _launch(q, k, positions, cos, sin, None)


def apply_rotary_write_kv_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """apply_rotary_(q, k, ...) then kv_write.write_kv(k, v, kv_layer, slot_mapping), in one launch: the programs
    that rotate k also store it, and v, in the token's pool slot. Same arguments and checks as the two."""
    _check(q, k, positions, cos, sin)
    check_kv_write_args(k, v, kv_layer, slot_mapping)
    _launch(q, k, positions, cos, sin, (v, kv_layer, slot_mapping))


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,  # (v, kv_layer, slot_mapping) to store K/V
) -> None:
    num_tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    if num_tokens == 0:
        return
    if write is None:
        kv_args: tuple[object, ...] = (q, 0, 0, q, 0, 0, 0, 0, positions)  # placeholders: WRITE_KV is off
        page_size = 1
    else:
        v, kv_layer, slot_mapping = write
        kv_args = (v, v.stride(0), v.stride(1), kv_layer, *kv_layer.stride()[:4], slot_mapping)
        page_size = kv_layer.shape[2]
    block_half = next_power_of_2(head_dim // 2)
    block_q = _heads_per_program(q_heads, block_half)
    block_k = _heads_per_program(k_heads, block_half)
    q_blocks = cdiv(q_heads, block_q)
    grid = (num_tokens, q_blocks + cdiv(k_heads, block_k))
    launch_cached(_rotary_kernel, grid,
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), positions, positions.stride(0),
        cos, sin, cos.stride(0), sin.stride(0), *kv_args,
        Q_HEADS=q_heads, K_HEADS=k_heads, HALF=head_dim // 2, Q_BLOCKS=q_blocks,
        BLOCK_Q=block_q, BLOCK_K=block_k, BLOCK_HALF=block_half, WRITE_KV=write is not None, PAGE_SIZE=page_size,
        num_warps=4,
    )  # fmt: skip


def _heads_per_program(heads: int, block_half: int) -> int:
    # As many heads as fit in TILE elements, and no more than there are.
    return max(1, min(next_power_of_2(heads), TILE // (2 * block_half)))


def _check(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [num_tokens, heads, head_dim], got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} need the same num_tokens and head_dim")
    num_tokens, _, head_dim = q.shape
    if head_dim <= 0 or head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even and positive to split in halves, got {head_dim}")
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"q and k need unit stride along head_dim, got strides {q.stride()} and {k.stride()}")
    if q.dtype not in ROTARY_DTYPES or k.dtype != q.dtype:
        raise ValueError(f"q and k must share a dtype among float32, float16, bfloat16, got {q.dtype}, {k.dtype}")
    if positions.dtype != torch.int64 or positions.shape != (num_tokens,):
        got = f"{positions.dtype} {tuple(positions.shape)}"
        raise ValueError(f"positions must be int64 [{num_tokens}], got {got}")
    if cos.dim() != 2 or cos.shape[1] != head_dim:
        raise ValueError(f"cos must be [max_positions, {head_dim}], got {tuple(cos.shape)}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin {tuple(sin.shape)} must have cos's shape {tuple(cos.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype != q.dtype:
            raise ValueError(f"{name} dtype {table.dtype} must be q's dtype {q.dtype}")
        if table.stride(1) != 1:
            raise ValueError(f"{name} needs unit stride along head_dim, got strides {table.stride()}")
