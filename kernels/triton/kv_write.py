"""Store each new token's K and V in its pool slot: kv_layer[page, 0|1, offset] = k|v[token].

One program per token copies all its kv_heads × head_dim elements of K and of V. The slot is
page * block_size + offset (AttentionMeta.slot_mapping); a negative slot means "no slot" and is skipped.
Pure data movement: the pool holds exactly the bits of k and v afterwards.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slora.kernels.triton.launch import next_power_of_2
from slora.kernels.triton.relaunch import launch_cached


@triton.jit
def _kv_write_kernel(
    k_ptr,  # [num_tokens, kv_heads, head_dim], unit stride along head_dim
    v_ptr,  # same shape as k (may be a strided view of the fused qkv output)
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    kv_ptr,  # one pool layer viewed as [num_pages, 2, block_size, kv_heads, head_dim]
    stride_page,
    stride_kv,  # K half to V half of a page
    stride_slot,
    stride_head,
    slot_mapping_ptr,  # int64 [num_tokens]
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,  # tokens per page
    BLOCK_H: tl.constexpr,  # next power of two >= KV_HEADS
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        page = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < KV_HEADS) & (d < HEAD_DIM)
        dst = kv_ptr + page * stride_page + offset * stride_slot + h * stride_head + d
        k = tl.load(k_ptr + token.to(tl.int64) * stride_k_tok + h * stride_k_head + d, mask=mask)
        v = tl.load(v_ptr + token.to(tl.int64) * stride_v_tok + h * stride_v_head + d, mask=mask)
        tl.store(dst, k, mask=mask)
        tl.store(dst + stride_kv, v, mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, kv_heads, head_dim]; kv_layer: [num_pages, 2, block_size, kv_heads, head_dim] (written)."""
    check_kv_write_args(k, v, kv_layer, slot_mapping)
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    launch_cached(_kv_write_kernel, (num_tokens,),
        k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_layer, kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        slot_mapping,
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=kv_layer.shape[2],
        BLOCK_H=next_power_of_2(kv_heads), BLOCK_D=next_power_of_2(head_dim),
        num_warps=4,
    )  # fmt: skip


def check_kv_write_args(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [num_tokens, kv_heads, head_dim], got {k.shape} and {v.shape}")
    if k.stride(2) != 1 or v.stride(2) != 1 or kv_layer.stride(4) != 1:
        raise ValueError("k, v and kv_layer need unit stride along head_dim")
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2 or kv_layer.shape[3:] != k.shape[1:]:
        expected = f"[num_pages, 2, block_size, {k.shape[1]}, {k.shape[2]}]"
        raise ValueError(f"kv_layer {tuple(kv_layer.shape)} is not {expected}")
    if k.dtype != kv_layer.dtype or v.dtype != kv_layer.dtype:
        raise ValueError(f"k, v ({k.dtype}, {v.dtype}) must have the pool's dtype {kv_layer.dtype}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (k.shape[0],):
        got = f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        raise ValueError(f"slot_mapping must be int64 [{k.shape[0]}], got {got}")
