"""The unified page pool: one owner per page, nothing lost, counts by kind always agree."""

from __future__ import annotations

import random

import pytest
import torch

from slora.backend.memory.page_pool import PageKind, PagePool, PoolGeometry, PoolIntegrityError

GEOMETRY = PoolGeometry(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)


def make_pool(num_pages: int = 32) -> PagePool:
    return PagePool(GEOMETRY, num_pages, torch.float32, torch.device("cpu"))


def test_alloc_and_free_keep_counts() -> None:
    pool = make_pool(10)
    kv = pool.alloc(4, PageKind.KV, ("kv", "a"))
    adapter = pool.alloc(3, PageKind.ADAPTER, ("adapter", "x"))
    assert kv is not None and adapter is not None and not set(kv) & set(adapter)
    assert (pool.count(PageKind.FREE), pool.count(PageKind.KV), pool.count(PageKind.ADAPTER)) == (3, 4, 3)
    assert pool.alloc(4, PageKind.KV, ("kv", "b")) is None  # too few free: nothing taken
    assert pool.num_free == 3
    pool.free(kv[:2], ("kv", "a"))
    pool.free_all(("kv", "a"))
    pool.free_all(("adapter", "x"))
    assert pool.num_free == 10
    pool.check_integrity()


def test_random_sequences_keep_integrity() -> None:
    rng = random.Random(0)
    pool = make_pool(64)
    held: dict[tuple[str, int], list[int]] = {}
    for _ in range(2000):
        if held and rng.random() < 0.45:
            owner = rng.choice(list(held))
            pages = held[owner]
            give_back = rng.sample(pages, rng.randint(1, len(pages)))
            pool.free(give_back, owner)
            held[owner] = [p for p in pages if p not in give_back]
            if not held[owner]:
                del held[owner]
        else:
            owner = (rng.choice(["kv", "adapter"]), rng.randrange(12))
            kind = PageKind.KV if owner[0] == "kv" else PageKind.ADAPTER
            got = pool.alloc(rng.randint(0, 9), kind, owner)
            if got:
                held.setdefault(owner, []).extend(got)
        pool.check_integrity()
        assert sum(len(p) for p in held.values()) + pool.num_free == pool.num_pages
    for owner in list(held):
        pool.free_all(owner)
    assert pool.num_free == 64


def test_freeing_a_page_one_does_not_own_is_refused() -> None:
    pool = make_pool(4)
    pages = pool.alloc(2, PageKind.KV, ("kv", "a"))
    assert pages is not None
    with pytest.raises(PoolIntegrityError, match="not owned"):
        pool.free(pages, ("kv", "b"))
    pool.free(pages, ("kv", "a"))
    with pytest.raises(PoolIntegrityError, match="not owned"):
        pool.free(pages, ("kv", "a"))  # double free
    pool.check_integrity()


def test_integrity_check_detects_corruption() -> None:
    pool = make_pool(8)
    pool.alloc(3, PageKind.KV, ("kv", "a"))
    pool._free.append(pool._free[-1])  # a page on the free list twice
    with pytest.raises(PoolIntegrityError):
        pool.check_integrity()
    pool = make_pool(8)
    pool._free.pop()  # a page lost
    with pytest.raises(PoolIntegrityError, match="lost"):
        pool.check_integrity()


def test_views_address_the_same_storage() -> None:
    pool = make_pool(6)
    kv = pool.kv_layer(1)
    assert kv.shape == (6, 2, GEOMETRY.block_size, GEOMETRY.num_kv_heads, GEOMETRY.head_dim)
    kv[3, 1, 2, 1, 5] = 7.0
    offset = 3 * GEOMETRY.page_elems + ((1 * GEOMETRY.block_size + 2) * GEOMETRY.num_kv_heads + 1) * 8 + 5
    assert pool.flat_layer(1)[offset] == 7.0
    assert pool.flat_layer(0).abs().sum() == 0


def test_geometry_refuses_pages_narrower_than_a_row() -> None:
    with pytest.raises(ValueError, match="page_size >= 3"):
        PoolGeometry(num_layers=1, block_size=2, num_kv_heads=1, head_dim=64).validate(widest_row=300)


@pytest.mark.parametrize(
    ("kv_heads", "widest_row", "tokens"),
    [
        (32, 11008, 16),  # Llama-2-7B: 16 tokens of 32 KV heads hold any row
        (8, 14336, 16),  # Llama-3-8B
        (4, 18944, 32),  # Qwen2.5-7B: 16 tokens of 4 KV heads are 16384 elements, its MLP rows 18944
        (1, 40000, 256),
    ],
)
def test_auto_page_size_is_the_smallest_doubling_that_holds_the_widest_row(
    kv_heads: int, widest_row: int, tokens: int
) -> None:
    geometry = PoolGeometry.holding(2, None, kv_heads, 128, widest_row)
    assert geometry.block_size == tokens
    assert geometry.page_elems >= widest_row
    assert tokens == 16 or PoolGeometry(2, tokens // 2, kv_heads, 128).page_elems < widest_row


def test_a_given_page_size_is_kept_or_refused_naming_it() -> None:
    assert PoolGeometry.holding(2, 8, 32, 128, 11008).block_size == 8
    with pytest.raises(ValueError, match=r"page_size=16 tokens .* use page_size >= 19"):
        PoolGeometry.holding(2, 16, 4, 128, 18944)
