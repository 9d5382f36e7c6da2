"""The page pool with a reserved adapter region (the "no unified memory" ablation): each kind allocates from its own
region, integrity catches a page outside its region, and the unified pool hands out pages exactly as before."""

from __future__ import annotations

import random

import pytest
import torch

from slora.backend.memory.page_pool import PageKind, PagePool, PoolGeometry, PoolIntegrityError

GEOMETRY = PoolGeometry(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)


def make_pool(num_pages: int, adapter_pages: int | None) -> PagePool:
    return PagePool(GEOMETRY, num_pages, torch.float32, torch.device("cpu"), adapter_pages)


def test_each_kind_allocates_from_its_region() -> None:
    pool = make_pool(10, adapter_pages=4)
    assert not pool.unified
    assert (pool.num_pages_for(PageKind.ADAPTER), pool.num_pages_for(PageKind.KV)) == (4, 6)
    assert pool.alloc(3, PageKind.ADAPTER, ("adapter", "x")) == [0, 1, 2]
    assert pool.alloc(2, PageKind.KV, ("kv", "a")) == [4, 5]
    assert (pool.num_free_for(PageKind.ADAPTER), pool.num_free_for(PageKind.KV), pool.num_free) == (1, 4, 5)
    # Free pages of the other region do not count: nothing is taken.
    assert pool.alloc(2, PageKind.ADAPTER, ("adapter", "y")) is None
    assert pool.alloc(5, PageKind.KV, ("kv", "b")) is None
    assert (pool.num_free_for(PageKind.ADAPTER), pool.num_free_for(PageKind.KV)) == (1, 4)
    pool.check_integrity()


def test_freed_pages_go_back_to_their_region() -> None:
    pool = make_pool(6, adapter_pages=2)
    adapter = pool.alloc(2, PageKind.ADAPTER, ("adapter", "x"))
    kv = pool.alloc(4, PageKind.KV, ("kv", "a"))
    assert adapter == [0, 1] and kv == [2, 3, 4, 5] and pool.num_free == 0
    pool.free_all(("adapter", "x"))
    assert (pool.num_free_for(PageKind.ADAPTER), pool.num_free_for(PageKind.KV)) == (2, 0)
    assert pool.alloc(1, PageKind.KV, ("kv", "b")) is None  # the adapter pages freed are no use to KV
    pool.free([kv[1]], ("kv", "a"))
    assert pool.alloc(1, PageKind.KV, ("kv", "b")) == [kv[1]]  # most recently freed first, within the region
    pool.check_integrity()


def test_random_sequences_keep_integrity_in_both_regions() -> None:
    rng = random.Random(1)
    pool = make_pool(48, adapter_pages=16)
    held: dict[tuple[str, int], list[int]] = {}
    for _ in range(1500):
        if held and rng.random() < 0.45:
            owner = rng.choice(list(held))
            give_back = rng.sample(held[owner], rng.randint(1, len(held[owner])))
            pool.free(give_back, owner)
            held[owner] = [p for p in held[owner] if p not in give_back]
            if not held[owner]:
                del held[owner]
        else:
            owner = (rng.choice(["kv", "adapter"]), rng.randrange(10))
            kind = PageKind.KV if owner[0] == "kv" else PageKind.ADAPTER
            got = pool.alloc(rng.randint(0, 7), kind, owner)
            if got:
                assert all((p < 16) == (kind == PageKind.ADAPTER) for p in got)
                held.setdefault(owner, []).extend(got)
        pool.check_integrity()
        adapter_held = sum(len(p) for o, p in held.items() if o[0] == "adapter")
        assert pool.num_free_for(PageKind.ADAPTER) + adapter_held == 16
        assert sum(len(p) for p in held.values()) + pool.num_free == pool.num_pages


def test_integrity_catches_a_page_of_the_wrong_region() -> None:
    pool = make_pool(8, adapter_pages=3)
    pages = pool.alloc(1, PageKind.ADAPTER, ("adapter", "x"))
    assert pages is not None
    page = pages[0]
    pool._kind[page] = PageKind.KV  # an adapter-region page recorded as KV
    pool._count[PageKind.ADAPTER] -= 1
    pool._count[PageKind.KV] += 1
    with pytest.raises(PoolIntegrityError, match="outside the KV region"):
        pool.check_integrity()
    pool = make_pool(8, adapter_pages=3)
    kv_region, adapter_region = pool._region_of[PageKind.KV], pool._region_of[PageKind.ADAPTER]
    adapter_region.free.append(kv_region.free.pop())  # a KV page on the adapter region's free list
    with pytest.raises(PoolIntegrityError, match="outside their region"):
        pool.check_integrity()


def test_integrity_still_catches_lost_and_doubly_listed_pages() -> None:
    pool = make_pool(8, adapter_pages=3)
    pool._region_of[PageKind.KV].free.pop()
    with pytest.raises(PoolIntegrityError, match="lost"):
        pool.check_integrity()
    pool = make_pool(8, adapter_pages=3)
    free = pool._region_of[PageKind.ADAPTER].free
    free.append(free[0])
    with pytest.raises(PoolIntegrityError, match="twice"):
        pool.check_integrity()


@pytest.mark.parametrize("adapter_pages", [0, 8, -1, 9])
def test_regions_must_leave_pages_for_both_kinds(adapter_pages: int) -> None:
    with pytest.raises(ValueError, match="adapter_pages"):
        make_pool(8, adapter_pages)


def test_unified_pool_hands_out_pages_as_before() -> None:
    """Against the unified pool's original free list (lowest first, then last freed first): the same pages."""
    pool = make_pool(32, adapter_pages=None)
    assert pool.unified
    assert pool.num_pages_for(PageKind.KV) == pool.num_pages_for(PageKind.ADAPTER) == 32
    model = list(range(31, -1, -1))
    rng = random.Random(2)
    held: dict[tuple[str, int], list[int]] = {}
    for _ in range(1000):
        if held and rng.random() < 0.45:
            owner = rng.choice(list(held))
            give_back = rng.sample(held[owner], rng.randint(1, len(held[owner])))
            pool.free(give_back, owner)
            model.extend(give_back)
            held[owner] = [p for p in held[owner] if p not in give_back]
            if not held[owner]:
                del held[owner]
            continue
        owner = (rng.choice(["kv", "adapter"]), rng.randrange(8))
        n = rng.randint(0, 6)
        got = pool.alloc(n, PageKind.KV if owner[0] == "kv" else PageKind.ADAPTER, owner)
        expected = [model.pop() for _ in range(n)] if n <= len(model) else None
        assert got == expected
        if got:
            held.setdefault(owner, []).extend(got)
        assert pool.num_free_for(PageKind.KV) == pool.num_free_for(PageKind.ADAPTER) == pool.num_free == len(model)
        pool.check_integrity()
    assert pool._free == model
