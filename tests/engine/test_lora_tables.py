"""LoraTablesCache: a step with the previous step's adapters (same objects, same order) reuses their tables; any
other list is rebuilt, and a reused or rebuilt table equals a fresh build."""

from __future__ import annotations

import dataclasses

import torch

from slora.backend.adapter_cache import ResidentAdapter
from slora.backend.lora_tables import LoraTables, LoraTablesCache, build_tables
from slora.backend.page_pool import PoolGeometry
from tests.kernels.builders import DEVICE, TINY, adapter_pages, make_adapter, make_resident, scrambled_pool

RANKS = [(8, 8, 8, 8, 0, 0, 0), (4, 0, 4, 0, 2, 2, 2), (16, 16, 16, 16, 16, 16, 16)]


def _residents(seed: int) -> list[ResidentAdapter]:
    geometry = PoolGeometry(num_layers=1, block_size=16, num_kv_heads=TINY.kv_heads, head_dim=TINY.head_dim)
    hosts = [make_adapter(f"a{i}", r, TINY, geometry, torch.float32, seed + i) for i, r in enumerate(RANKS)]
    pool = scrambled_pool(geometry, adapter_pages(hosts) + 5, torch.float32, seed)
    return make_resident(pool, hosts)


def _equal(a: LoraTables, b: LoraTables) -> bool:
    for field in dataclasses.fields(LoraTables):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if not (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y):
            return False
    return True


def test_same_adapters_reuse_the_tables_other_lists_rebuild() -> None:
    residents = _residents(seed=1)
    cache = LoraTablesCache()
    first = cache.get(residents, DEVICE)
    assert _equal(first, build_tables(residents, DEVICE))
    assert cache.get(list(residents), DEVICE) is first and cache.hits == 1  # same objects, a new list
    reordered = cache.get(residents[::-1], DEVICE)
    assert reordered is not first and _equal(reordered, build_tables(residents[::-1], DEVICE))
    fewer = cache.get(residents[::-1][:2], DEVICE)
    assert fewer is not reordered and fewer.ranks_host == [list(RANKS[2]), list(RANKS[1])]


def test_an_adapter_copied_elsewhere_is_not_mistaken_for_the_old_copy() -> None:
    """Same names, new ResidentAdapter objects (as after an eviction and a reload): rebuilt, with their rows."""
    cache = LoraTablesCache()
    old = cache.get(_residents(seed=2), DEVICE)
    reloaded = _residents(seed=3)
    new = cache.get(reloaded, DEVICE)
    assert new is not old and cache.hits == 0 and _equal(new, build_tables(reloaded, DEVICE))
