"""Which adapters are resident in the page pool, their page addresses, pins and LRU order.

An adapter is pinned while a running request uses it (refcount > 0) and is never evicted then. Unpinned resident
adapters stay, for reuse, until their pages are wanted: `evict` frees least recently used ones first. Copies from
host memory go on a side CUDA stream, so loading an adapter for the next batch overlaps the current forward; the
runner waits on the adapter's `ready` event before a batch that reads it.

Host images are ordinary (pageable) memory unless `pin_host_adapters` is set: page-locking each adapter costs far
more than the copy (2000 7B rank-8 adapters, 33.5 GB, took 148 s to pin on the H200 host). Instead one page-locked
staging buffer, grown to the largest adapter, takes each image with a CPU copy, from which the GPU copy runs
asynchronously; the next load waits for that copy before reusing the buffer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from slora.backend.adapter import HostAdapter
from slora.backend.page_pool import PageKind, PagePool

logger = logging.getLogger(__name__)

AdapterKey = tuple[str, int]


@dataclass
class ResidentAdapter:
    host: HostAdapter
    pages: list[int]
    a_rows: torch.Tensor  # int64 [sum(ranks)] on CPU: element offset of each lora_A row in a flat pool layer
    b_rows: torch.Tensor  # int64 [sum(ranks)] on CPU: element offset of each lora_Bᵀ row
    ready: torch.cuda.Event | None = None
    refcount: int = 0
    last_used: int = 0

    @property
    def key(self) -> AdapterKey:
        return self.host.key


class AdapterCache:
    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self._resident: dict[AdapterKey, ResidentAdapter] = {}
        self._clock = 0
        self.loads = 0
        self.evictions = 0
        self._copy_stream = torch.cuda.Stream(pool.storage.device) if pool.storage.is_cuda else None
        self._staging: torch.Tensor | None = None  # page-locked, flat, model dtype
        self._staging_done: torch.cuda.Event | None = None  # the last copy out of the staging buffer

    def __contains__(self, key: AdapterKey) -> bool:
        return key in self._resident

    def __len__(self) -> int:
        return len(self._resident)

    def get(self, key: AdapterKey) -> ResidentAdapter | None:
        return self._resident.get(key)

    def resident(self) -> list[ResidentAdapter]:
        return list(self._resident.values())

    def load(self, host: HostAdapter) -> ResidentAdapter | None:
        """Make `host` resident using free pages only; None when the pool lacks them (nothing changes)."""
        found = self._resident.get(host.key)
        if found is not None:
            return found
        pages = self.pool.alloc(host.num_pages, PageKind.ADAPTER, ("adapter", host.key))
        if pages is None:
            return None
        resident = self._copy_in(host, pages)
        self._resident[host.key] = resident
        self.loads += 1
        return resident

    def pin(self, resident: ResidentAdapter) -> None:
        resident.refcount += 1
        self.touch(resident)

    def unpin(self, resident: ResidentAdapter) -> None:
        if resident.refcount <= 0:
            raise RuntimeError(f"adapter {resident.host.name!r} unpinned more often than pinned")
        resident.refcount -= 1

    def touch(self, resident: ResidentAdapter) -> None:
        self._clock += 1
        resident.last_used = self._clock

    def evictable_pages(self, keep: frozenset[AdapterKey] = frozenset()) -> int:
        return sum(len(r.pages) for r in self._resident.values() if r.refcount == 0 and r.key not in keep)

    def evict(self, pages_wanted: int, keep: frozenset[AdapterKey] = frozenset()) -> bool:
        """Evict unpinned adapters (least recently used first, sparing `keep`) until `pages_wanted` are free.

        Returns whether that many pages are free now; evicts nothing when it cannot reach the goal.
        """
        if self.pool.num_free >= pages_wanted:
            return True
        if self.pool.num_free + self.evictable_pages(keep) < pages_wanted:
            return False
        victims = sorted(
            (r for r in self._resident.values() if r.refcount == 0 and r.key not in keep),
            key=lambda r: r.last_used,
        )
        for victim in victims:
            if self.pool.num_free >= pages_wanted:
                break
            self._evict(victim)
        return True

    def drop_stale(self, live: set[AdapterKey]) -> None:
        """Evict unpinned adapters whose name was registered again or removed (not in `live`)."""
        for resident in list(self._resident.values()):
            if resident.refcount == 0 and resident.key not in live:
                self._evict(resident)

    def _evict(self, resident: ResidentAdapter) -> None:
        if resident.ready is not None:
            # A copy into these pages may still be in flight on the side stream.
            torch.cuda.current_stream(self.pool.storage.device).wait_event(resident.ready)
        self.pool.free(resident.pages, ("adapter", resident.key))
        del self._resident[resident.key]
        self.evictions += 1
        logger.debug("evicted adapter %r from the pool", resident.host.name)

    def _copy_in(self, host: HostAdapter, pages: list[int]) -> ResidentAdapter:
        page_elems = self.pool.geometry.page_elems
        page_index = torch.tensor(pages, dtype=torch.int64)
        a_rows = page_index[host.a_local // page_elems] * page_elems + host.a_local % page_elems
        b_rows = page_index[host.b_local // page_elems] * page_elems + host.b_local % page_elems
        storage = self.pool.storage
        if self._copy_stream is None:
            storage.index_copy_(1, page_index.to(storage.device), host.image.to(storage.device))
            return ResidentAdapter(host, pages, a_rows, b_rows)
        # No wait on the compute stream: these pages were free before this step was scheduled, and the engine
        # synchronizes at the end of every step, so no kernel in flight reads or writes them.
        source = host.image if host.image.is_pinned() else self._stage(host.image)
        with torch.cuda.stream(self._copy_stream):
            image = source.to(storage.device, non_blocking=True)
            storage.index_copy_(1, page_index.to(storage.device, non_blocking=True), image)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        if source is not host.image:
            self._staging_done = ready
        return ResidentAdapter(host, pages, a_rows, b_rows, ready=ready)

    def _stage(self, image: torch.Tensor) -> torch.Tensor:
        """`image` copied into the page-locked staging buffer (after the previous copy out of it finished)."""
        if self._staging_done is not None:
            self._staging_done.synchronize()
        if self._staging is None or self._staging.numel() < image.numel():
            self._staging = torch.empty(image.numel(), dtype=image.dtype, pin_memory=True)
        staged = self._staging[: image.numel()].view(image.shape)
        staged.copy_(image)
        return staged
