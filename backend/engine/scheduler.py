"""Iteration-level scheduling over the unified pool: who runs this step, with how many tokens.

Each step: (1) running requests first, in admission order: one token each when decoding, the next chunk when
prefilling; if a request needs a page and none is free, unpinned adapters are evicted, then a request not yet
scheduled this step is preempted (its pages freed; it is recomputed later): the policy's choice, under fcfs the
most recently admitted. (2) If nothing was preempted (and, with admit_interval > 1 while requests run, on every
admit_interval-th step), waiting requests are admitted in the policy's order (fcfs: arrival order) while the
token budget, the sequence limit and the pool allow: a request is admitted only when its adapter is (or can be
made) resident and pinned and the pages for its whole prompt are allocated; with admit_when_copied, a request whose
adapter copy is not issued yet is passed over while others run (it keeps its place at the head of the queue).
(3) Adapters of the next waiting requests are copied into free pages ahead of time.

Admission order and preemption victims are the scheduling policy's (scheduling_policy.py: fcfs, fair,
priority). With first-token SLOs or a queue timeout, waiting requests that can no longer meet them are refused
before they are admitted (slo.py).

The scheduler owns each request's pages and adapter pin; the pool only counts pages.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from slora.backend.engine.outputs import TenantStats
from slora.backend.engine.request import FinishReason, Request, RequestStatus
from slora.backend.engine.scheduling_policy import FcfsPolicy, SchedulingPolicy
from slora.backend.engine.slo import SWEEP_INTERVAL_S, SloGuard, SloSettings
from slora.backend.engine.tenants import TenantBook, served_tokens
from slora.backend.errors import SloRefusedError
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
    refused: list[tuple[Request, SloRefusedError]] = field(default_factory=list)  # finished: "rejected"

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


class Scheduler:
    FORGET_EVERY = 1024  # admissions between two passes that drop the bookkeeping of idle tenants

    def __init__(
        self,
        limits: SchedulerLimits,
        pool: PagePool,
        adapters: AdapterCache,
        policy: SchedulingPolicy | None = None,
        book: TenantBook | None = None,
        guard: SloGuard | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.pool = pool
        self.adapters = adapters
        self.block_size = pool.geometry.block_size
        self.policy = policy if policy is not None else FcfsPolicy()  # (an empty queue is falsy)
        self.book = book if book is not None else TenantBook()
        self.guard = guard if guard is not None else SloGuard(SloSettings())
        self.clock = clock  # what request arrival times are measured with
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.refusals: Counter[str] = Counter()  # SLO refusals by reason (slo.RefusalReason)
        self._steps_since_admission = 0
        self._admissions = 0
        settings = self.guard.settings
        self._deadlines = settings.ttft_slo_s is not None or settings.queue_timeout_s is not None

    @property
    def waiting(self) -> SchedulingPolicy:
        """The waiting requests (len, iteration, `in`), held in the policy's order."""
        return self.policy

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def add(self, request: Request) -> None:
        self.policy.push(request)
        if request.ttft_deadline is not None or request.queue_deadline is not None:
            self._deadlines = True  # from now on each step checks the queue for requests that would be late

    def has_work(self) -> bool:
        return bool(self.policy or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        now = self.clock() if self._deadlines else 0.0
        if self._deadlines:
            self._refuse_late(out, now)
        budget = self._schedule_running(out, self.limits.max_batch_tokens)
        admitted = 0
        admission = not out.preempted and self._admission_due()
        if admission:
            admitted = self._admit_waiting(out, budget)
        self.policy.served(out.seqs)
        self._prefetch()
        if self._deadlines and out.seqs:
            prefill = sum(s.num_tokens for s in out.seqs if s.num_tokens > 1)
            self.guard.meter.planned(now, admitted, prefill, admission, bool(self.policy))
        elif self._deadlines:
            self.guard.meter.idle()  # nothing runs this step (all refused, or every last token in flight)
        return out

    def tenant_stats(self, limit: int) -> list[TenantStats]:
        """The `limit` tenants with most requests waiting and running; tokens served include the running ones'."""
        if limit <= 0:
            return []
        waiting = Counter(r.tenant for r in self.policy)
        running = Counter(r.tenant for r in self.running)
        depth = waiting + running
        tenants = sorted(depth, key=lambda t: (-depth[t], t))[:limit]
        progress: dict[str, list[int]] = {t: [0, 0] for t in tenants}
        for request in self.running:
            if request.tenant in progress:
                prompt, output = served_tokens(request)
                progress[request.tenant][0] += prompt
                progress[request.tenant][1] += output
        out = []
        for t in tenants:
            usage = self.book.usage.get(t)
            done = (usage.prompt_tokens, usage.output_tokens) if usage is not None else (0, 0)
            out.append(TenantStats(t, self.book.weight(t), waiting[t], running[t], done[0] + progress[t][0],
                                   done[1] + progress[t][1], self.policy.counter(t)))  # fmt: skip
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
        elif request in self.policy:
            self.policy.remove(request)
        self._free(request)
        request.status = RequestStatus.FINISHED
        self.book.finished(request)
        if not self.has_work():
            self.guard.meter.idle()  # no step until new work comes: that wait is not a step's time

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
        """Give `request` pages for `num_tokens`, preempting the policy's victims; False if it preempted itself."""
        need = self.pages_for(num_tokens) - len(request.pages)
        while need > 0:
            pages = self._alloc(need, request)
            if pages is not None:
                request.pages += pages
                return True
            # Among the requests not scheduled yet this step (`request` and those after it): none is in `out`.
            start = self.running.index(request)
            victim = self.policy.victim(self.running[start:])
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
        self.policy.push_preempted(request)

    def _free(self, request: Request) -> None:
        if request.pages:
            self.pool.free(request.pages, ("kv", request.request_id))
            request.pages = []
        if request.resident is not None:
            self.adapters.unpin(request.resident)
            request.resident = None

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit from the head of the policy's queue; returns how many were admitted."""
        # Requests passed over (their adapter copy not issued) keep their place in the queue, ahead of the rest.
        # Admission stops after prefetch_adapters of them (each may have started an adapter load).
        passed_over: list[Request] = []
        may_pass = self.limits.admit_when_copied and bool(out.seqs)  # only while other work keeps the step busy
        max_passes = max(self.limits.prefetch_adapters, 1)
        admitted_count = 0
        while self.policy and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            if may_pass and len(passed_over) >= max_passes:
                break
            request = self.policy.peek()
            if request is None:
                break
            if self._deadlines and self._refuse_if_late(request, out):
                continue
            admitted = self._admit(request, may_pass)
            if admitted is None:
                self.policy.set_aside(request)
                passed_over.append(request)
                continue
            if not admitted:
                break
            self.policy.take(request)
            self.running.append(request)
            n = min(request.num_pending, budget)
            out.seqs.append(ScheduledSeq(request, n))
            budget -= n
            admitted_count += 1
        self.policy.put_back(passed_over)
        self._count_admissions(admitted_count)
        return admitted_count

    def _count_admissions(self, n: int) -> None:
        """Every FORGET_EVERY admissions, drop what the policy and the book keep of tenants now idle."""
        before, self._admissions = self._admissions, self._admissions + n
        if before // self.FORGET_EVERY != self._admissions // self.FORGET_EVERY:
            busy = {r.tenant for r in self.running}
            self.policy.forget_idle(busy)
            self.book.forget_idle(busy | {r.tenant for r in self.policy})

    # ---- SLO refusals -----------------------------------------------------------------------------------------

    def _refuse_late(self, out: SchedulerOutput, now: float) -> None:
        """Every SWEEP_INTERVAL_S, refuse the waiting requests that can no longer meet their SLO (slo.py)."""
        if now < self.guard.next_sweep or not self.policy:
            return
        self.guard.next_sweep = now + SWEEP_INTERVAL_S
        late = [(r, error) for r, ahead in self.policy.positions() if (error := self.guard.check(r, now, ahead))]
        for request, error in late:
            self._refuse(request, error, out)

    def _refuse_if_late(self, request: Request, out: SchedulerOutput) -> bool:
        """At its admission: refuse `request` if its first token cannot come in time even when admitted now."""
        error = self.guard.check(request, self.clock(), None)
        if error is not None:
            self._refuse(request, error, out)
        return error is not None

    def _refuse(self, request: Request, error: SloRefusedError, out: SchedulerOutput) -> None:
        logger.debug("%s", error)  # counted in the statistics; under overload there are many
        self.policy.remove(request)
        self._free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = FinishReason.REJECTED
        self.book.finished(request)
        self.refusals[error.reason] += 1
        out.refused.append((request, error))

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
        for request in self.policy.upcoming():
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
