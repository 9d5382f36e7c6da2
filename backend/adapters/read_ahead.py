"""The scheduler's window of adapter reads: waiting requests' adapters being read into host memory ahead of use.

A waiting request holds only its adapter's AdapterRef. When the scheduler reaches it (prefetch walks the queue in
the policy's order; admission takes its head) and host memory does not hold the adapter, a read starts on one of
the store's reader threads and the request waits for it without holding up anyone: the engine thread never reads
a disk. The window bounds what those reads hold: at most `max_reads` adapters and `max_bytes` bytes (beyond the
store's own budget, since the store may drop an adapter read ahead before its request is admitted; the window
keeps it until then). A read asked for with `force` (the queue's head) starts even when the window is full, so
that the head always makes progress.

Engine thread only; the reads themselves run on the store's threads.
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future
from typing import Protocol

from slora.backend.adapters.host_adapter import AdapterRef, HostAdapter
from slora.backend.errors import AdapterError, SloraError

AdapterKey = tuple[str, int]


class HostSource(Protocol):
    """What the window needs of the adapter store (store.py)."""

    def lookup(self, ref: AdapterRef) -> HostAdapter | None: ...

    def fetch(self, ref: AdapterRef) -> Future[HostAdapter]: ...


class ReadAhead:
    def __init__(self, hosts: HostSource, max_reads: int, max_bytes: int) -> None:
        self.hosts = hosts
        self.max_reads = max(1, max_reads)
        self.max_bytes = max_bytes
        self._reads: dict[AdapterKey, tuple[AdapterRef, Future[HostAdapter]]] = {}

    def __len__(self) -> int:
        return len(self._reads)

    def host_copy(self, ref: AdapterRef, start: bool = True, force: bool = False) -> HostAdapter | None:
        """`ref`'s adapter when host memory holds it or its read is done; otherwise None, after starting its read
        (if `start`, and the window has room or `force`). Raises AdapterError when its read failed (the read stays
        in the window until `forget`, so that prefetch does not start it again)."""
        host = self.hosts.lookup(ref)
        if host is not None:
            return host
        entry = self._reads.get(ref.key)
        if entry is None:
            if start and (force or self._has_room(ref)):
                self._reads[ref.key] = (ref, self.hosts.fetch(ref))
            return None
        future = entry[1]
        if not future.done():
            return None
        error = future.exception()
        if error is not None:
            raise (
                error
                if isinstance(error, SloraError)
                else AdapterError(f"adapter {ref.name!r}: reading it failed: {error!r}")
            )
        return future.result()

    def forget(self, ref: AdapterRef) -> None:
        """Drop `ref`'s read from the window: its adapter is resident now, or its read failed and was reported."""
        self._reads.pop(ref.key, None)

    def keep_only(self, keys: set[AdapterKey]) -> None:
        """Drop finished reads of adapters not in `keys` (no longer among the next waiting requests': they are read
        again when their turn comes, from host memory if the store still holds them)."""
        self._reads = {k: e for k, e in self._reads.items() if k in keys or not e[1].done()}

    def wait(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for one read under way to finish (for an engine with nothing else to do)."""
        pending = [future for _, future in self._reads.values() if not future.done()]
        if pending:
            concurrent.futures.wait(pending, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def pending(self) -> int:
        return sum(1 for _, future in self._reads.values() if not future.done())

    def _has_room(self, ref: AdapterRef) -> bool:
        held = sum(r.nbytes for r, _ in self._reads.values())
        return not self._reads or (len(self._reads) < self.max_reads and held + ref.nbytes <= self.max_bytes)
