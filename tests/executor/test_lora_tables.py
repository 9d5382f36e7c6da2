"""LoraTablesCache: a step with the previous step's adapters (same objects, same order) reuses their tables; any
other list is rebuilt, and a reused or rebuilt table equals a fresh build."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from slora.backend.executor.lora_tables import LoraTables, LoraTablesCache, build_tables
from slora.backend.memory.adapter_cache import ResidentAdapter
from slora.backend.memory.page_pool import PoolGeometry
from slora.kernels.metadata import row_alignment
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
    assert cache.builds == 1
    reordered = cache.get(residents[::-1], DEVICE)
    assert reordered is not first and _equal(reordered, build_tables(residents[::-1], DEVICE))
    fewer = cache.get(residents[::-1][:2], DEVICE)
    assert fewer is not reordered and fewer.ranks_host == [list(RANKS[2]), list(RANKS[1])]
    assert cache.builds == 3 and cache.hits == 1


@pytest.mark.parametrize("index", [None, 0], ids=["unindexed", "indexed"])
def test_the_device_as_given_hits(index: int | None) -> None:
    """The engine passes torch.device("cuda"), whose tensors report "cuda:0" (on CPU: "cpu:0" given, "cpu"
    reported): the cache compares the device it was asked for, so the next step with the same adapters hits."""
    residents = _residents(seed=4)
    device = torch.device(DEVICE.type, index)
    cache = LoraTablesCache()
    first = cache.get(residents, device)
    assert cache.get(residents, device) is first and cache.hits == 1


def test_an_adapter_copied_elsewhere_is_not_mistaken_for_the_old_copy() -> None:
    """Same names, new ResidentAdapter objects (as after an eviction and a reload): rebuilt, with their rows."""
    cache = LoraTablesCache()
    old = cache.get(_residents(seed=2), DEVICE)
    reloaded = _residents(seed=3)
    new = cache.get(reloaded, DEVICE)
    assert new is not old and cache.hits == 0 and _equal(new, build_tables(reloaded, DEVICE))


def _brute_alignment(rows: list[int], cap: int = 16) -> int:
    return max(a for a in (1, 2, 4, 8, 16) if a <= cap and all(r % a == 0 for r in rows))


def test_tables_hold_each_adapters_rows_in_list_order() -> None:
    """Against a construction from each adapter's own fields: ranks, scales, row starts (adapters, then modules),
    row offsets concatenated in list order, and the largest power of two up to 16 dividing every offset."""
    residents = _residents(seed=4)[::-1]
    t = build_tables(residents, DEVICE)
    assert t.ranks_host == [list(r.host.ranks) for r in residents]
    assert t.scales_host == [list(r.host.scales) for r in residents]
    starts, row = [], 0
    for r in residents:
        starts.append([])
        for rank in r.host.ranks:
            starts[-1].append(row)
            row += rank
    assert t.row_start_host == starts
    a_rows = [int(x) for r in residents for x in r.a_rows]
    b_rows = [int(x) for r in residents for x in r.b_rows]
    assert t.a_rows.tolist() == a_rows and t.b_rows.tolist() == b_rows and len(a_rows) == row
    assert t.ranks.tolist() == t.ranks_host and t.row_start.tolist() == starts
    assert t.max_rank == max(max(r.host.ranks) for r in residents)
    assert t.row_align == _brute_alignment(a_rows + b_rows)


@pytest.mark.parametrize("shift", [0, 1, 2, 3, 4, 6])
def test_row_alignment_is_the_largest_power_of_two_dividing_every_offset(shift: int) -> None:
    rng = np.random.default_rng(shift)
    rows = (rng.integers(1, 1 << 20, size=50) << shift).tolist()
    assert row_alignment(torch.tensor(rows, dtype=torch.int64)) == _brute_alignment(rows)
    assert row_alignment(torch.tensor(rows, dtype=torch.int64), cap=4) == _brute_alignment(rows, cap=4)
    assert row_alignment(torch.zeros(3, dtype=torch.int64)) == 16  # offsets of 0 are aligned to anything
