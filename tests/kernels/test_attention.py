"""Paged attention (general and split decode) and the K/V write, against the plain-torch references.

Pools are filled with random values everywhere (stale slots past a sequence's end included) and hand out pages in
scrambled order; metadata comes from build_batch. Block sizes 4, 8, 16 and 32; GQA and MHA.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from slora.backend.memory.page_pool import PagePool, PoolGeometry  # noqa: E402
from slora.kernels.reference.attention import paged_attention_ref, write_kv_ref  # noqa: E402
from slora.kernels.triton.kv_write import write_kv  # noqa: E402
from slora.kernels.triton.ops import TritonOps  # noqa: E402
from slora.kernels.triton.paged_attention import (  # noqa: E402
    AttentionConfig,
    attention_config,
    heads_per_program,
    paged_attention,
)
from slora.kernels.triton.paged_decode import DecodeConfig, paged_decode_attention  # noqa: E402
from tests.kernels.builders import (  # noqa: E402
    DEVICE,
    Heads,
    assert_close,
    attention_step,
    gpu_only,
    scrambled_pool,
)

BLOCK_SIZES = (4, 8, 16, 32)


GQA = Heads(4, 2, 16)
# GQA, MHA, one kv head with an odd head_dim, a group of 7 (Qwen2.5-7B's: padded to 8 rows a token)
CPU_HEADS = (GQA, Heads(2, 2, 16), Heads(6, 1, 24), Heads(14, 2, 16))

# (new tokens, context length) per sequence.
CPU_STEPS = {
    "prompts": [(5, 5), (17, 17), (1, 1), (40, 40)],
    "chunks": [(8, 40), (3, 3), (16, 70)],
    "mixed": [(20, 20), (1, 37), (1, 5), (7, 50)],
    "decode": [(1, 1), (1, 5), (1, 37), (1, 64), (1, 100)],
}
# Tiny tiles and partitions, so that small contexts still take several steps and several partitions.
SMALL_DECODE = DecodeConfig(
    block_n=16, min_partition=16, max_partitions=8, programs_per_sm=64, num_warps=4, num_stages=2
)
SMALL_PREFILL = AttentionConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)


def make_pool(heads: Heads, block_size: int, dtype: torch.dtype, tokens: int, seed: int, low: int = 0) -> PagePool:
    geometry = PoolGeometry(num_layers=1, block_size=block_size, num_kv_heads=heads.kv_heads, head_dim=heads.head_dim)
    # The low pages stay busy, so that K/V live at high pool offsets.
    return scrambled_pool(geometry, low + tokens // block_size + 64, dtype, seed, low=low)


def check_attention(
    heads: Heads,
    block_size: int,
    dtype: torch.dtype,
    step: list[tuple[int, int]],
    run,  # type: ignore[no-untyped-def]
    seed: int = 0,
    low_pages: int = 0,
) -> None:
    pool = make_pool(heads, block_size, dtype, sum(n for _, n in step) + block_size * len(step), seed, low_pages)
    batch = attention_step(pool, [q for q, _ in step], [n for _, n in step])
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    q = torch.randn((batch.num_tokens, heads.heads, heads.head_dim), generator=gen, device=DEVICE).to(dtype)
    kv_layer = pool.kv_layer(0)
    scale = heads.head_dim**-0.5
    expected = paged_attention_ref(q, kv_layer, batch.attn, scale)
    actual = run(q, kv_layer, batch.attn, scale)
    assert_close(actual, expected, dtype, magnitude=float(expected.float().abs().max()))


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("step", sorted(CPU_STEPS))
def test_attention_block_sizes(step: str, block_size: int) -> None:
    """TritonOps.attention: the decode kernel for decode-only steps, the general one otherwise."""
    check_attention(GQA, block_size, torch.float32, CPU_STEPS[step], TritonOps().attention)


@pytest.mark.parametrize("step", ["prompts", "mixed"])
def test_attention_heads_apart_in_prompt_tiles(step: str) -> None:
    """A group of 4 query heads: decode-shaped tiles take the group in one program, prompt-sized tiles (64 tokens
    × 4 heads, past MAX_PACKED_ROWS) one head each; both in one step."""
    heads = Heads(8, 2, 16)
    assert heads_per_program(attention_config(4, 1).block_m, 4) == 4
    assert heads_per_program(attention_config(4, 64).block_m, 4) == 1
    check_attention(heads, 8, torch.float32, CPU_STEPS[step], TritonOps().attention, seed=4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads", CPU_HEADS, ids=str)
@pytest.mark.parametrize("step", ["chunks", "mixed"])
def test_paged_attention(step: str, heads: Heads, dtype: torch.dtype) -> None:
    run = lambda q, kv, meta, scale: paged_attention(q, kv, meta, scale, SMALL_PREFILL)  # noqa: E731
    check_attention(heads, 8, dtype, CPU_STEPS[step], run, seed=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads", CPU_HEADS, ids=str)
def test_decode_split_partitions(heads: Heads, dtype: torch.dtype) -> None:
    """Sequences split into up to 7 partitions, merged by the reduce step; a 1-token context is one partition."""
    run = lambda q, kv, meta, scale: paged_decode_attention(q, kv, meta, scale, SMALL_DECODE)  # noqa: E731
    check_attention(heads, 16, dtype, CPU_STEPS["decode"], run, seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_write_kv_is_exact(block_size: int, dtype: torch.dtype) -> None:
    """K and V (strided views of a fused qkv row, as model.py passes them) land bit-exactly; nothing else moves."""
    check_write_kv(GQA, block_size, dtype, [(8, 40), (1, 1), (5, 5), (1, 33)], seed=block_size)


def check_write_kv(heads: Heads, block_size: int, dtype: torch.dtype, step: list[tuple[int, int]], seed: int) -> None:
    pool = make_pool(heads, block_size, dtype, sum(n for _, n in step) + block_size * len(step), seed)
    batch = attention_step(pool, [q for q, _ in step], [n for _, n in step])
    kv_size = heads.kv_heads * heads.head_dim
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    qkv = torch.randn((batch.num_tokens, heads.heads * heads.head_dim + 2 * kv_size), generator=gen, device=DEVICE)
    _, k, v = qkv.to(dtype).split((heads.heads * heads.head_dim, kv_size, kv_size), dim=-1)
    k = k.reshape(-1, heads.kv_heads, heads.head_dim)
    v = v.reshape(-1, heads.kv_heads, heads.head_dim)
    expected = pool.kv_layer(0).clone()
    write_kv_ref(k, v, expected, batch.attn.slot_mapping)
    TritonOps().write_kv(k, v, pool.kv_layer(0), batch.attn)
    assert torch.equal(pool.kv_layer(0), expected)


def test_write_kv_skips_negative_slots() -> None:
    pool = make_pool(GQA, 4, torch.float32, 16, seed=5)
    before = pool.storage.clone()
    k = torch.randn((2, GQA.kv_heads, GQA.head_dim), device=DEVICE)
    write_kv(k, k, pool.kv_layer(0), torch.tensor([-1, -1], dtype=torch.int64, device=DEVICE))
    assert torch.equal(pool.storage, before)


# Full shapes on the GPU: Llama-2-7B (MHA), Llama-3-8B (GQA), SmolLM2-135M, Qwen2.5-7B.
GPU_HEADS = (Heads(32, 32, 128), Heads(32, 8, 128), Heads(9, 3, 64), Heads(28, 4, 128))


def gpu_steps() -> dict[str, list[tuple[int, int]]]:
    rng = random.Random(0)
    return {
        "decode64": [(1, rng.randint(1, 4096)) for _ in range(64)],
        "decode1-long": [(1, 8191)],
        "prompts": [(rng.randint(1, 1500), 0) for _ in range(4)],
        "chunks": [(512, 3000), (77, 77), (1, 2000), (256, 257)],
        # a step with prompts of a saturated server: mostly decodes, whose query heads share each K/V read
        "decodes-and-prompts": [(1, rng.randint(1, 1024)) for _ in range(200)] + [(300, 300), (9, 600), (64, 700)],
    }


@gpu_only
@pytest.mark.parametrize("heads", GPU_HEADS, ids=str)
@pytest.mark.parametrize("step", sorted(gpu_steps()))
def test_attention_full_shapes(step: str, heads: Heads) -> None:
    seqs = [(q, n or q) for q, n in gpu_steps()[step]]
    check_attention(heads, 16, torch.bfloat16, seqs, TritonOps().attention, seed=7)


@gpu_only
@pytest.mark.parametrize("block_size", [4, 8, 32])
@pytest.mark.parametrize("step", sorted(gpu_steps()))
def test_attention_full_shapes_block_sizes(step: str, block_size: int) -> None:
    seqs = [(q, n or q) for q, n in gpu_steps()[step]]
    check_attention(GPU_HEADS[1], block_size, torch.bfloat16, seqs, TritonOps().attention, seed=8)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("step", sorted(gpu_steps()))
def test_attention_full_shapes_dtypes(step: str, dtype: torch.dtype) -> None:
    seqs = [(q, n or q) for q, n in gpu_steps()[step]]
    check_attention(GPU_HEADS[1], 16, dtype, seqs, TritonOps().attention, seed=8)


@gpu_only
@pytest.mark.parametrize("heads", GPU_HEADS, ids=str)
def test_write_kv_full_shapes(heads: Heads) -> None:
    check_write_kv(heads, 16, torch.bfloat16, [(1000, 1000), (1, 3000), (300, 700)], seed=9)


@gpu_only
@pytest.mark.parametrize("step", ["decode64", "chunks"])
def test_attention_pages_beyond_int32_offsets(step: str) -> None:
    """A pool layer of more than 2**31 elements with every sequence's pages above that offset."""
    heads = GPU_HEADS[0]
    low = (1 << 31) // (16 * 2 * heads.kv_heads * heads.head_dim)
    seqs = [(q, n or q) for q, n in gpu_steps()[step]]
    check_attention(heads, 16, torch.bfloat16, seqs, TritonOps().attention, seed=10, low_pages=low)
