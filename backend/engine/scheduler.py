"""Iteration-level scheduling over the unified pool: who runs this step, with how many tokens.

Each step: (1) running requests first, in admission order: one token each when decoding, the next chunk when
prefilling; if a request needs a page and none is free, unpinned adapters are evicted, then the most recently
admitted request is preempted (its pages freed; it is recomputed later). (2) If nothing was preempted (and, with
admit_interval > 1 while requests run, on every admit_interval-th step), waiting requests are admitted in
arrival order while the token budget, the sequence limit and the pool allow: a request
is admitted only when its adapter is (or can be made) resident and pinned and the pages for its whole prompt are
allocated; with admit_when_copied, a request whose adapter copy is not issued yet is passed over while others run
(it stays at the head of the queue). (3) Adapters of the next waiting requests are copied into free pages ahead of time.

The scheduler owns each request's pages and adapter pin; the pool only counts pages.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from slora.backend.engine.request import Request, RequestStatus
from slora.backend.executor.batch import ScheduledSeq
from slora.backend.memory.adapter_cache import AdapterCache
from slora.backend.memory.page_pool import PageKind, PagePool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_tokens: int
    max_num_seqs: int
    prefetch_adapters: int
    admit_interval: int = 1  # while requests run, admit waiting ones every Nth step (EngineConfig.admit_interval)
    admit_when_copied: bool = False  # pass over requests whose adapter copy is not issued (EngineConfig)


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


class Scheduler:
    def __init__(self, limits: SchedulerLimits, pool: PagePool, adapters: AdapterCache) -> None:
        self.limits = limits
        self.pool = pool
        self.adapters = adapters
        self.block_size = pool.geometry.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._steps_since_admission = 0

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.limits.max_batch_tokens)
        if not out.preempted and self._admission_due():
            self._admit_waiting(out, budget)
        self._prefetch()
        return out

    def _admission_due(self) -> bool:
        """Every step when nothing runs (or admit_interval is 1), else every admit_interval-th step."""
        self._steps_since_admission += 1
        if not self.running or self._steps_since_admission >= self.limits.admit_interval:
            self._steps_since_admission = 0
            return True
        return False

    def release(self, request: Request) -> None:
        """Take a finished or aborted request out of the queues and give back its pages and adapter pin."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free(request)
        request.status = RequestStatus.FINISHED

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_pending, budget)
            if n == 0 or request.ends_in_flight:  # its last token is still being sampled (overlapped steps)
                i += 1
                continue
            if not self._grow(request, request.num_computed + n, out):
                continue  # `request` itself was preempted; the list shifted
            out.seqs.append(ScheduledSeq(request, n))
            budget -= n
            i += 1
        return budget

    def _grow(self, request: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Give `request` pages for `num_tokens`, preempting from the tail; False if it preempted itself."""
        need = self.pages_for(num_tokens) - len(request.pages)
        while need > 0:
            pages = self._alloc(need, request)
            if pages is not None:
                request.pages += pages
                return True
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _alloc(self, n: int, request: Request) -> list[int] | None:
        pages = self.pool.alloc(n, PageKind.KV, ("kv", request.request_id))
        if pages is None and self.adapters.evict(n):
            pages = self.pool.alloc(n, PageKind.KV, ("kv", request.request_id))
        return pages

    def _preempt(self, request: Request) -> None:
        logger.info("preempting request %s (pool full); it will be recomputed", request.request_id)
        self.running.remove(request)
        self._free(request)
        request.num_computed = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _free(self, request: Request) -> None:
        if request.pages:
            self.pool.free(request.pages, ("kv", request.request_id))
            request.pages = []
        if request.resident is not None:
            self.adapters.unpin(request.resident)
            request.resident = None

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        # Requests passed over (their adapter copy not issued) stay in the queue, in order, ahead of the rest.
        # Admission stops after prefetch_adapters of them (each may have started an adapter load).
        passed_over: list[Request] = []
        may_pass = self.limits.admit_when_copied and bool(out.seqs)  # only while other work keeps the step busy
        max_passes = max(self.limits.prefetch_adapters, 1)
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            if may_pass and len(passed_over) >= max_passes:
                break
            request = self.waiting[0]
            admitted = self._admit(request, may_pass)
            if admitted is None:
                passed_over.append(self.waiting.popleft())
                continue
            if not admitted:
                break
            self.waiting.popleft()
            self.running.append(request)
            n = min(request.num_pending, budget)
            out.seqs.append(ScheduledSeq(request, n))
            budget -= n
        self.waiting.extendleft(reversed(passed_over))

    def _admit(self, request: Request, may_pass: bool = False) -> bool | None:
        """Pin the request's adapter and allocate pages for all its tokens; on failure change nothing. None (with
        `may_pass`): its adapter is resident but the copy into its pages is not issued yet; nothing pinned."""
        if request.adapter is not None:
            resident = self.adapters.get(request.adapter.key)
            if resident is None:
                if not self.adapters.evict(request.adapter.num_pages):
                    return False
                resident = self.adapters.load(request.adapter)
                if resident is None:
                    return False
            if may_pass and not resident.copy_issued:
                self.adapters.touch(resident)
                return None
            self.adapters.pin(resident)
            request.resident = resident
        pages = self._alloc(self.pages_for(request.num_tokens), request)
        if pages is None:
            self._free(request)
            return False
        request.pages = pages
        request.status = RequestStatus.RUNNING
        return True

    def _prefetch(self) -> None:
        """Copy adapters of the next waiting requests into free pages, keeping a page per running request."""
        reserve = len(self.running)
        seen: set[tuple[str, int]] = set()
        for request in self.waiting:
            if len(seen) >= self.limits.prefetch_adapters:
                break
            adapter = request.adapter
            if adapter is None or adapter.key in seen:
                continue
            seen.add(adapter.key)
            resident = self.adapters.get(adapter.key)
            if resident is None and self.pool.num_free - adapter.num_pages >= reserve:
                resident = self.adapters.load(adapter)
            if resident is not None:
                self.adapters.touch(resident)
