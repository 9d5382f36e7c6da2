"""Pools, adapters and per-step metadata for the kernel tests, built through the engine's own code.

Adapters are host images of pages (a plain layout of our own), made resident by AdapterCache (which turns local row
offsets into pool offsets), and described by build_lora_meta / build_batch, as in a real step. The pool's free
list is shuffled first, so adapter rows and K/V blocks land on pages in scrambled order.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from slora.backend.adapters.host_adapter import HostAdapter
from slora.backend.engine.request import Request
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.executor.batch import ForwardBatch, ScheduledSeq, build_batch, build_lora_meta, order_by_adapter
from slora.backend.memory.adapter_cache import AdapterCache, ResidentAdapter
from slora.backend.memory.page_pool import PageKind, PagePool, PoolGeometry
from slora.backend.model.spec import LORA_MODULES, ModelSpec, RopeSpec
from slora.kernels.metadata import LoraMeta

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


@dataclass(frozen=True)
class Heads:
    """Attention head counts of a test case (query heads, kv heads, head_dim)."""

    heads: int
    kv_heads: int
    head_dim: int

    def __str__(self) -> str:
        return f"{self.heads}x{self.kv_heads}x{self.head_dim}"


def gpu_only(test: Callable[..., None]) -> Callable[..., None]:
    """Full shapes run on the GPU only; the CPU interpreter takes the small cases."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")(test))


# Error allowed relative to the size of the result (see assert_close).
TOLERANCE = {torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}

Q, K, V, O, GATE, UP, DOWN = range(len(LORA_MODULES))  # noqa: E741


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    def __str__(self) -> str:
        return f"h{self.hidden}-i{self.intermediate}-{self.heads}x{self.kv_heads}x{self.head_dim}"


TINY = Shape(hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=16)
FULL_SHAPES = (
    Shape(576, 1536, 9, 3, 64),  # SmolLM2-135M
    Shape(2048, 11008, 16, 8, 128),
    Shape(4096, 11008, 32, 32, 128),  # Llama-2-7B
    Shape(5120, 14336, 40, 8, 128),
    Shape(8192, 14336, 64, 8, 128),
)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, magnitude: float) -> None:
    """Elementwise |actual - expected| <= tol * (magnitude + |expected|), tol by dtype."""
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol * magnitude, rtol=tol)


def model_spec(shape: Shape) -> ModelSpec:
    return ModelSpec(
        architecture="LlamaForCausalLM",
        vocab_size=32,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_layers=1,
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        rms_norm_eps=1e-6,
        rope=RopeSpec(theta=10000.0),
        max_position_embeddings=1 << 16,
        tie_word_embeddings=False,
        qkv_bias=False,
    )


def scrambled_pool(geometry: PoolGeometry, num_pages: int, dtype: torch.dtype, seed: int, low: int = 0) -> PagePool:
    """A pool of random contents whose free pages are handed out in a random order.

    The `low` lowest pages stay held (owner "low"), so that everything allocated later lives above them.
    """
    pool = PagePool(geometry, num_pages, dtype, DEVICE)
    pages = pool.alloc(num_pages, PageKind.KV, "low")
    assert pages is not None
    high = [p for p in pages if p >= low]
    random.Random(seed).shuffle(high)
    pool.free(high, "low")
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    pool.storage.normal_(0.0, 1.0, generator=gen)
    return pool


def module_widths(shape: Shape) -> dict[int, tuple[int, int]]:
    spec = model_spec(shape)
    return {m: spec.module_shape(name) for m, name in enumerate(LORA_MODULES)}


def make_adapter(
    name: str, ranks: tuple[int, ...], shape: Shape, geometry: PoolGeometry, dtype: torch.dtype, seed: int
) -> HostAdapter:
    """A random adapter with the given rank per module (0 = not targeted), as a host image of pages.

    Rows are packed one after another, each starting on a new page when the current one cannot hold it all, so
    rows of different widths share pages: a plain layout, not the loader's, that any kernel must read alike.
    """
    widths = module_widths(shape)
    cursor = 0
    a_local, b_local = [], []
    for m, rank in enumerate(ranks):
        for width, out in ((widths[m][0], a_local), (widths[m][1], b_local)):
            for _ in range(rank):
                if cursor % geometry.page_elems + width > geometry.page_elems:
                    cursor = -(-cursor // geometry.page_elems) * geometry.page_elems
                out.append(cursor)
                cursor += width
    num_pages = -(-cursor // geometry.page_elems)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    image = torch.randn((1, num_pages, geometry.page_elems), generator=gen, device=DEVICE).to(dtype) * 0.1
    scales = tuple(0.5 + (seed * 7 + m) % 5 / 4 if r else 0.0 for m, r in enumerate(ranks))
    return HostAdapter(
        name=name,
        path=Path(name),
        ranks=ranks,
        scales=scales,
        image=image,
        a_local=torch.tensor(a_local, dtype=torch.int64),
        b_local=torch.tensor(b_local, dtype=torch.int64),
    )


def make_resident(pool: PagePool, adapters: list[HostAdapter]) -> list[ResidentAdapter]:
    if HAS_CUDA:
        torch.cuda.synchronize()  # the copies below run on a side stream: images and pool must be written first
    cache = AdapterCache(pool)
    residents = []
    for host in adapters:
        resident = cache.load(host)
        assert resident is not None, "test pool too small"
        residents.append(resident)
    for resident in residents:
        resident.wait_copied(pool.storage.device)  # the copies run on the copier's thread (and a side stream)
    if HAS_CUDA:
        torch.cuda.synchronize()
    return residents


def adapter_pages(adapters: list[HostAdapter]) -> int:
    return sum(a.num_pages for a in adapters)


def lora_step(residents: list[ResidentAdapter | None], num_tokens: list[int]) -> tuple[LoraMeta, list[int]]:
    """LoraMeta of a step whose request i runs num_tokens[i] tokens with residents[i] (None = base model).

    Returns the metadata and, per token row, the request it belongs to (after grouping by adapter).
    """
    seqs = [ScheduledSeq(_request(i, n, 0, resident=r), n) for i, (r, n) in enumerate(zip(residents, num_tokens))]
    seqs = order_by_adapter(seqs)
    q_start = [0]
    rows: list[int] = []
    for s in seqs:
        q_start.append(q_start[-1] + s.num_tokens)
        rows += [int(s.request.request_id)] * s.num_tokens
    meta = build_lora_meta(seqs, q_start, DEVICE)
    assert meta is not None
    return meta, rows


def attention_step(pool: PagePool, q_lens: list[int], seq_lens: list[int]) -> ForwardBatch:
    """A step of sequences whose last q_lens[i] of seq_lens[i] tokens are new, with pages from `pool`."""
    block_size = pool.geometry.block_size
    seqs = []
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        pages = pool.alloc(-(-seq_len // block_size), PageKind.KV, ("seq", i))
        assert pages is not None, "test pool too small"
        seqs.append(ScheduledSeq(_request(i, seq_len, seq_len - q_len, pages=pages), q_len))
    return build_batch(seqs, block_size, DEVICE)


def _request(
    i: int, length: int, computed: int, resident: ResidentAdapter | None = None, pages: list[int] | None = None
) -> Request:
    return Request(
        request_id=str(i),
        token_ids=[1] * length,
        num_prompt=length,
        sampling=SamplingParams(),
        num_computed=computed,
        pages=pages or [],
        resident=resident,
    )
