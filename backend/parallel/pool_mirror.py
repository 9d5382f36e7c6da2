"""Every rank's page pool keeps rank 0's page table: rank 0's pool records, a follower's replays.

Rank 0's scheduler is the only one that decides: it allocates and frees pages of its own pool as with one device.
Each rank's pool has the same number of pages (the smallest any rank can hold), and each page index names the
rank's share of the same KV block or adapter rows (page_pool.py, adapter_shard.py). The record of rank 0's
allocations, frees and adapter copies goes to the followers with the next step (or integrity check), and they
make the same calls in the same order: a pool's free list is deterministic, so each hands out the same pages, and
a follower that did not is a bug that stops it (PoolIntegrityError). `digest` summarizes a page table, so that
rank 0's check_integrity can also compare every follower's with its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from slora.backend.adapters.host_adapter import HostAdapter
from slora.backend.memory.adapter_cache import AdapterCache, ResidentAdapter
from slora.backend.memory.page_pool import Owner, PageKind, PagePool, PoolGeometry, PoolIntegrityError
from slora.backend.parallel.adapter_shard import ShardedHostAdapter
from slora.backend.parallel.messages import AdapterCopy, PoolAlloc, PoolEvent, PoolFree


class MirroredPagePool(PagePool):
    """A PagePool that records its allocations and frees (rank 0) or replays rank 0's (followers)."""

    def __init__(
        self, geometry: PoolGeometry, num_pages: int, dtype: torch.dtype, device: torch.device, record: bool
    ) -> None:
        super().__init__(geometry, num_pages, dtype, device)
        self.record = record
        self.events: list[PoolEvent] = []  # since the last take_events (rank 0)

    def alloc(self, n: int, kind: PageKind, owner: Owner) -> list[int] | None:
        pages = super().alloc(n, kind, owner)
        if self.record and pages:
            self.events.append(PoolAlloc(kind, owner, tuple(pages)))
        return pages

    def free(self, pages: Iterable[int], owner: Owner) -> None:
        pages = list(pages)
        super().free(pages, owner)
        if self.record and pages:
            self.events.append(PoolFree(owner, tuple(pages)))

    def take_events(self) -> list[PoolEvent]:
        events, self.events = self.events, []
        return events

    def replay(self, event: PoolAlloc | PoolFree) -> None:
        """Make rank 0's call; raise PoolIntegrityError if this pool hands out other pages than rank 0's did."""
        if isinstance(event, PoolFree):
            self.free(event.pages, event.owner)
            return
        pages = self.alloc(len(event.pages), event.kind, event.owner)
        if pages is None or tuple(pages) != event.pages:
            raise PoolIntegrityError(
                f"the pool diverged from rank 0's: {event.owner!r} got pages {pages}, rank 0 gave {list(event.pages)}"
            )

    def digest(self) -> str:
        """A hash of the page table: who owns which pages, of which kind, and the free list's order."""
        owners = sorted((repr(owner), sorted(pages)) for owner, pages in self._by_owner.items())
        text = repr((owners, [int(kind) for kind in self._kind], self._free))
        return hashlib.sha1(text.encode()).hexdigest()


class RecordingAdapterCache(AdapterCache):
    """Rank 0's AdapterCache: each adapter made resident is recorded for the followers, right after its pages."""

    pool: MirroredPagePool

    def __init__(self, pool: MirroredPagePool) -> None:
        super().__init__(pool)

    def load(self, host: HostAdapter) -> ResidentAdapter | None:
        was_resident = host.key in self
        resident = super().load(host)
        if resident is not None and not was_resident:
            if not isinstance(host, ShardedHostAdapter):
                raise TypeError(f"adapter {host.name!r} was not read as a tensor-parallel shard")
            self.pool.events.append(AdapterCopy(host.key, str(host.path), host.fingerprint, tuple(resident.pages)))
        return resident
