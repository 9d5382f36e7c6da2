"""Eviction takes adapters whose copy into the pool is issued before one whose copy is still queued: evicting that
one would make the engine thread wait for the copier."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

import torch

from slora.backend.adapters.host_adapter import HostAdapter
from slora.backend.memory.adapter_cache import AdapterCache, ResidentAdapter
from slora.backend.memory.page_pool import PagePool, PoolGeometry

GEOMETRY = PoolGeometry(num_layers=2, block_size=4, num_kv_heads=1, head_dim=4)
PAGES = 5  # each adapter's; three of them leave one of the pool's 16 pages free


def _host(name: str) -> HostAdapter:
    image = torch.randn((GEOMETRY.num_layers, PAGES, GEOMETRY.page_elems))
    empty = torch.zeros(0, dtype=torch.int64)
    return HostAdapter(name, Path(name), (2,) + (0,) * 6, (0.5,) + (0.0,) * 6, image, empty, empty)


def _full_cache() -> tuple[AdapterCache, list[ResidentAdapter]]:
    cache = AdapterCache(PagePool(GEOMETRY, 16, torch.float32, torch.device("cpu")))
    residents = []
    for name in ("oldest", "middle", "newest"):
        resident = cache.load(_host(name))
        assert resident is not None and resident.ready is not None
        resident.ready.result()  # copied (the copier's thread), not yet waited for by a batch
        cache.touch(resident)
        residents.append(resident)
    return cache, residents


def _evict_in_thread(cache: AdapterCache, pages: int) -> tuple[threading.Thread, list[bool]]:
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(cache.evict(pages)), daemon=True)
    thread.start()
    thread.join(timeout=5)
    return thread, result


def test_an_adapter_whose_copy_is_queued_is_evicted_after_those_copied() -> None:
    cache, (oldest, middle, newest) = _full_cache()
    queued: Future = Future()  # the copier has not reached this adapter's copy yet
    oldest.ready = queued
    try:
        thread, result = _evict_in_thread(cache, PAGES)
        assert not thread.is_alive(), "evict waited for a queued copy while a copied adapter could go"
        assert result == [True]
        assert cache.get(oldest.key) is oldest and cache.get(newest.key) is newest
        assert cache.get(middle.key) is None, "the least recently used adapter among those copied goes"
    finally:
        queued.set_result(None)


def test_a_queued_copy_is_waited_for_when_only_it_frees_enough() -> None:
    cache, (oldest, middle, newest) = _full_cache()
    queued: Future = Future()
    newest.ready = queued
    timer = threading.Timer(0.2, queued.set_result, (None,))
    timer.start()
    thread, result = _evict_in_thread(cache, 3 * PAGES)
    timer.join()
    assert not thread.is_alive() and result == [True]
    assert len(cache) == 0, "every unpinned adapter goes, the queued one once its copy is issued"
