"""Evicting an adapter whose copy into the pool has not started writing drops the copy instead of waiting for it:
waiting would hold the engine thread behind every copy queued before it, or behind the copy's staging. A copy already
writing is waited for."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from slora.backend.adapters.host_adapter import HostAdapter
from slora.backend.memory import adapter_copier
from slora.backend.memory.adapter_cache import AdapterCache, ResidentAdapter
from slora.backend.memory.page_pool import PagePool, PoolGeometry

GEOMETRY = PoolGeometry(num_layers=2, block_size=4, num_kv_heads=1, head_dim=4)
PAGES = 5  # each adapter's; three of them leave one of the pool's 16 pages free


def _host(name: str) -> HostAdapter:
    image = torch.randn((GEOMETRY.num_layers, PAGES, GEOMETRY.page_elems))
    empty = torch.zeros(0, dtype=torch.int64)
    return HostAdapter(name, Path(name), (2,) + (0,) * 6, (0.5,) + (0.0,) * 6, image, empty, empty)


def _cache() -> AdapterCache:
    return AdapterCache(PagePool(GEOMETRY, 16, torch.float32, torch.device("cpu")))


def _load(cache: AdapterCache, name: str) -> ResidentAdapter:
    resident = cache.load(_host(name))
    assert resident is not None
    cache.touch(resident)
    return resident


def _evict_in_thread(cache: AdapterCache, pages: int, timeout: float = 5) -> tuple[threading.Thread, list[bool]]:
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(cache.evict(pages)), daemon=True)
    thread.start()
    thread.join(timeout=timeout)
    return thread, result


def _evict_at_once(
    cache: AdapterCache, victim: ResidentAdapter, why: str
) -> tuple[list[ResidentAdapter], list[int], torch.Tensor]:
    """Fill the pool behind `victim` (the least recently used) and evict its pages' worth: it must go without
    waiting. Returns the adapters kept, the victim's pages and what they held before."""
    kept = [_load(cache, name) for name in ("middle", "newest")]
    pages = list(victim.pages)
    before = cache.pool.storage[:, pages].clone()
    thread, result = _evict_in_thread(cache, PAGES)
    assert not thread.is_alive(), why
    assert result == [True] and cache.get(victim.key) is None
    assert all(cache.get(r.key) is r for r in kept)
    return kept, pages, before


def test_a_queued_copy_is_dropped_without_waiting_for_the_copies_ahead_of_it() -> None:
    cache = _cache()
    release = threading.Event()
    busy = cache.copier._thread.submit(release.wait, 30)  # the copier's one thread is busy with an earlier copy
    try:
        queued = _load(cache, "queued")  # least recently used; its copy waits behind the busy one
        kept, pages, before = _evict_at_once(cache, queued, "evict waited for the copies queued ahead of the victim's")
        assert queued.ready is not None and queued.ready.cancelled()
    finally:
        release.set()
    busy.result()
    for resident in kept:
        resident.wait_copied(cache.pool.storage.device)
    assert torch.equal(cache.pool.storage[:, pages], before), "the dropped copy never wrote the freed pages"


def test_a_running_copy_is_waited_for_before_its_pages_are_freed() -> None:
    cache = _cache()
    victim = _load(cache, "running")
    for name in ("middle", "newest"):
        copy = _load(cache, name).ready
        assert copy is not None
        copy.result()
    running: Future = Future()
    running.set_running_or_notify_cancel()  # the copier is writing the victim's pages
    victim.ready = running
    copied_when_freed: list[bool] = []
    timer = threading.Timer(0.3, running.set_result, (None,))
    timer.start()
    thread = threading.Thread(target=lambda: copied_when_freed.append(cache.evict(PAGES) and running.done()))
    thread.start()
    thread.join(timeout=5)
    timer.join()
    assert copied_when_freed == [True], "its pages were freed before the copy into them had finished"
    assert not running.cancelled() and cache.get(victim.key) is None


def test_a_copy_still_staging_is_withdrawn_without_waiting_for_it() -> None:
    cache = _cache()
    copier, copy = cache.copier, cache.copier._copy
    entered, release = threading.Event(), threading.Event()

    def staging(*args: Any) -> Any:  # the copier has taken the copy and stages it (the GPU copy before it is slow)
        entered.set()
        release.wait(timeout=30)
        return copy(*args)

    copier._copy = staging
    try:
        victim = _load(cache, "staging")
        assert entered.wait(timeout=5)
        copier._copy = copy
        kept, pages, before = _evict_at_once(cache, victim, "evict waited for the victim's copy to be staged")
    finally:
        release.set()
    assert victim.ready is not None and not victim.ready.cancelled(), "it had started: withdrawn, not cancelled"
    assert victim.ready.result(timeout=5) is None
    for resident in kept:
        resident.wait_copied(cache.pool.storage.device)
    assert torch.equal(cache.pool.storage[:, pages], before), "the withdrawn copy never wrote the freed pages"


def test_a_copy_writing_the_pool_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _cache()
    writing, release = threading.Event(), threading.Event()
    write = adapter_copier.copy_pages_on_host

    def slow_write(storage: torch.Tensor, page_index: torch.Tensor, image: torch.Tensor) -> None:
        writing.set()
        release.wait(timeout=30)
        write(storage, page_index, image)

    monkeypatch.setattr(adapter_copier, "copy_pages_on_host", slow_write)
    victim = _load(cache, "writing")
    image = victim.host.image  # the resident drops it once copied
    assert writing.wait(timeout=5)
    monkeypatch.setattr(adapter_copier, "copy_pages_on_host", write)
    kept = [_load(cache, name) for name in ("middle", "newest")]  # the pool is full: the victim's pages are wanted
    thread, result = _evict_in_thread(cache, PAGES, timeout=0.3)
    assert thread.is_alive(), "its pages were freed while the copy wrote them"
    release.set()
    thread.join(timeout=5)
    assert result == [True] and cache.get(victim.key) is None
    assert all(cache.get(r.key) is r for r in kept)
    assert torch.equal(cache.pool.storage[:, victim.pages], image), "the copy finished before the free"
    assert victim.ready is None, "an issued copy is followed (on CUDA the compute stream waits for it), not withdrawn"
