"""Which adapters are resident in the page pool, their page addresses, pins and LRU order.

An adapter is pinned while a running request uses it (refcount > 0) and is never evicted then. Unpinned resident
adapters stay, for reuse, until their pages are wanted: `evict` frees least recently used ones first. Copies from
host memory run on the copier's thread (adapter_copier.py), so loading an adapter for the next batch overlaps the
current step; the runner waits for an adapter's copy before the first batch that reads it.

Host images are ordinary (pageable) memory unless `pin_host_adapters` is set: page-locking each adapter costs far
more than the copy (2000 7B rank-8 adapters, 33.5 GB, took 148 s to pin on the H200 host). The copier stages
them through a few page-locked buffers instead.

Once its copy is done a resident adapter keeps its HostAdapter without the image (HostAdapter.without_image): the
pool's copy is the one steps read, so the pool holds no host memory, and host memory stays within the store's
budget however many adapters the pool holds. An adapter evicted from the pool is read from the store again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from slora.backend.adapters.host_adapter import HostAdapter
from slora.backend.memory.adapter_copier import AdapterCopier, CopyDone
from slora.backend.memory.page_pool import PageKind, PagePool
from slora.kernels.metadata import offsets_or

logger = logging.getLogger(__name__)

AdapterKey = tuple[str, int]


@dataclass
class ResidentAdapter:
    host: HostAdapter
    pages: list[int]
    a_rows: np.ndarray  # int64 [sum(ranks)]: element offset of each lora_A row in a flat pool layer
    b_rows: np.ndarray  # int64 [sum(ranks)]: element offset of each lora_Bᵀ row
    ready: CopyDone | None = None  # the copy into the pool, until a batch has waited for it
    refcount: int = 0
    last_used: int = 0
    # Read by every step that runs the adapter (lora_tables.build_tables), so computed once here:
    key: AdapterKey = field(init=False)  # the host adapter's (name, generation)
    ranks: np.ndarray = field(init=False)  # int32 [7]
    scales: np.ndarray = field(init=False)  # float32 [7]
    rows_or: int = field(init=False)  # bitwise OR of every row offset: its lowest set bit bounds their alignment

    def __post_init__(self) -> None:
        self.key = self.host.key
        self.ranks = np.array(self.host.ranks, dtype=np.int32)
        self.scales = np.array(self.host.scales, dtype=np.float32)
        self.rows_or = offsets_or(self.a_rows) | offsets_or(self.b_rows)

    @property
    def copy_issued(self) -> bool:
        """Whether the copy into the pool is issued (on CUDA, a stream can follow it without the host waiting)."""
        return self.ready is None or self.ready.done()

    def release_image(self, _copy: object = None) -> None:
        """Drop the host image once the copy out of it is done (the copy's done-callback, on the copier's thread):
        from then on `host` answers every field but holds no memory."""
        self.host = self.host.without_image()

    def wait_copied(self, device: torch.device) -> None:
        """Wait until the copy into the pool is issued and, on CUDA, make the current stream follow it. Work
        queued after this on that stream follows the copy too, so each adapter needs this once."""
        if self.ready is None:
            return
        event = self.ready.result()
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)
        self.ready = None


class AdapterCache:
    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self._resident: dict[AdapterKey, ResidentAdapter] = {}
        self._clock = 0
        self.loads = 0
        self.evictions = 0
        self.copier = AdapterCopier(pool.storage)

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

    def can_free(self, pages_wanted: int, keep: frozenset[AdapterKey] = frozenset()) -> bool:
        """Whether `pages_wanted` adapter pages are free, or would be after evicting unpinned adapters (sparing
        `keep`); the evictable pages are summed only when the free ones fall short, since that walks every resident
        adapter."""
        free = self._free_pages()
        return pages_wanted <= free or pages_wanted <= free + self.evictable_pages(keep)

    def evict(self, pages_wanted: int, keep: frozenset[AdapterKey] = frozenset()) -> bool:
        """Evict unpinned adapters (least recently used first, sparing `keep`) until `pages_wanted` adapter pages
        are free (in the unified pool, pages for either kind; with a reserved adapter region, pages of that region,
        which KV cannot use).

        Returns whether that many pages are free now; evicts nothing when it cannot reach the goal.
        """
        if self._free_pages() >= pages_wanted:
            return True
        if not self.can_free(pages_wanted, keep):
            return False
        victims = sorted(
            (r for r in self._resident.values() if r.refcount == 0 and r.key not in keep),
            key=lambda r: r.last_used,
        )
        for victim in victims:
            if self._free_pages() >= pages_wanted:
                break
            self._evict(victim)
        return True

    def _free_pages(self) -> int:
        """Free pages an adapter can take: evicting one gives back pages of this count only."""
        return self.pool.num_free_for(PageKind.ADAPTER)

    def drop_stale(self, live: set[AdapterKey]) -> None:
        """Evict unpinned adapters whose name was registered again or removed (not in `live`)."""
        for resident in list(self._resident.values()):
            if resident.refcount == 0 and resident.key not in live:
                self._evict(resident)

    def _evict(self, resident: ResidentAdapter) -> None:
        # A copy that has not started writing (one copied ahead for a waiting request, under pool pressure) is
        # withdrawn: waiting for it would hold the engine thread, and the GPU's next step, behind every copy queued
        # before it, and behind its own staging, which waits for the GPU copy before it. One issued may still write
        # these pages: the compute stream follows it, which the host does not wait for.
        if resident.ready is None or not self.copier.withdraw(resident.ready):
            resident.wait_copied(self.pool.storage.device)
        self.pool.free(resident.pages, ("adapter", resident.key))
        del self._resident[resident.key]
        self.evictions += 1
        logger.debug("evicted adapter %r from the pool", resident.host.name)

    def _copy_in(self, host: HostAdapter, pages: list[int]) -> ResidentAdapter:
        page_elems = self.pool.geometry.page_elems
        page_index = np.array(pages, dtype=np.int64)
        a_local, b_local = host.a_local.numpy(), host.b_local.numpy()
        a_rows = page_index[a_local // page_elems] * page_elems + a_local % page_elems
        b_rows = page_index[b_local // page_elems] * page_elems + b_local % page_elems
        # The copier makes the copy wait for the work queued so far on the compute stream: with overlapped steps a
        # launched step may still read or write these pages, freed after it was launched.
        ready = self.copier.submit(host.image, torch.from_numpy(page_index))
        resident = ResidentAdapter(host, pages, a_rows, b_rows, ready=ready)
        ready.add_done_callback(resident.release_image)
        return resident
