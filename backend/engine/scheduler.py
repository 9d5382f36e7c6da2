"""Iteration-level scheduling over the unified pool: who runs this step, with how many tokens.

Each step: (1) running requests first, in admission order: one token each when decoding, the next chunk when
prefilling; if a request needs a page and none is free, unpinned adapters are evicted, then a request not yet
scheduled this step is preempted (its pages freed; it is recomputed later): the policy's choice, under fcfs the
most recently admitted. (2) If nothing was preempted (and, with admit_interval > 1 while requests run, on every
admit_interval-th step), waiting requests are admitted in the policy's order (fcfs: arrival order) while the
token budget, the sequence limit and the pool allow: a request is admitted only when its adapter is (or can be
made) resident and pinned and the pages for its whole prompt are allocated. Requests that cannot be admitted yet
are passed over and keep their place in the queue: one whose adapter is still being read into host memory (the read
runs on the store's threads whatever the step does), with admit_when_copied one whose adapter copy is not issued
yet while others run, and (bounded bypass) one the pool has no room for until max_bypass requests behind it have
been admitted ahead of it: then admission waits at it for room, as it always did without bypass. (3) Ahead of
admission, in the policy's order, adapters of the next waiting requests are copied into free pages and, further
ahead, read from disk into host memory (read_ahead.py). An adapter is copied into the pool, by admission or ahead of
it, only where its request's KV fits beside it: under pressure a request is tried step after step, and each try
would otherwise copy its adapter in and evict the one copied for the request tried before.

Admission order and preemption victims are the scheduling policy's (scheduling_policy.py: fcfs, fair,
priority). With first-token SLOs or a queue timeout, waiting requests that can no longer meet them are refused
before they are admitted (slo.py).

The scheduler owns each request's pages and adapter pin; the pool only counts pages. With a reserved adapter
region (EngineConfig.adapter_region_fraction) every page count is of the region a kind allocates from: KV that
lacks pages preempts at once (evicting adapters frees nothing for it), and adapters copied ahead keep no pages
back for the running requests' KV.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from slora.backend.adapters.host_adapter import AdapterRef, HostAdapter
from slora.backend.adapters.read_ahead import HostSource, ReadAhead
from slora.backend.engine.batch_limit import BatchLimiter
from slora.backend.engine.outputs import TenantStats
from slora.backend.engine.pace_limit import PaceLimiter
from slora.backend.engine.request import FinishReason, Request, RequestStatus
from slora.backend.engine.scheduling_policy import FairPolicy, FcfsPolicy, SchedulingPolicy
from slora.backend.engine.slo import SWEEP_INTERVAL_S, SloGuard, SloSettings
from slora.backend.engine.slot_shares import HEAVY_TARGET, DemandMeter, flooding, heavy, may_admit, shares
from slora.backend.engine.step_clock import Step, StepClock
from slora.backend.engine.step_totals import StepTotals
from slora.backend.engine.tenants import TenantBook, served_tokens
from slora.backend.errors import AdapterError, SloraError, SloRefusedError
from slora.backend.executor.batch import ScheduledSeq
from slora.backend.memory.adapter_cache import AdapterCache, ResidentAdapter
from slora.backend.memory.page_pool import PageKind, PagePool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_tokens: int
    max_num_seqs: int
    prefetch_adapters: int
    admit_interval: int = 1  # while requests run, admit waiting ones every Nth step (EngineConfig.admit_interval)
    admit_when_copied: bool = False  # pass over requests whose adapter copy is not issued (EngineConfig)
    read_ahead: int = 1  # adapters of the next waiting requests read into host memory ahead (EngineConfig)
    read_ahead_bytes: int = 0  # ... holding at most this many bytes (the queue's head is read whatever it takes)
    max_bypass: int = 0  # admissions ahead of a request the pool has no room for, at most (EngineConfig)


class Admission(enum.Enum):
    """What admitting a waiting request came to."""

    ADMITTED = "admitted"
    NO_ROOM = "no room"  # the pool lacks pages for its KV or its adapter now
    READING = "reading"  # its adapter is being read into host memory
    COPYING = "copying"  # its adapter's copy into the pool is not issued yet (admit_when_copied)


MAX_PASSES = 64  # waiting requests passed over in one step at most (each costs host time)
PREFETCH_SCAN = 512  # waiting requests prefetch looks at in one step at most
IDLE_READ_WAIT_S = 0.05  # with nothing to run but adapter reads under way, a step waits this long for one


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Finished "rejected": their SLO could not be met (SloRefusedError), or their adapter's read failed.
    refused: list[tuple[Request, SloraError]] = field(default_factory=list)
    reading: int = 0  # requests passed over because their adapter is still being read (the step may be empty)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


@dataclass
class _Shares:
    """One admission round's slot shares (slot_shares.py) and the tenants' running requests, kept up to date."""

    shares: dict[str, float]
    running: Counter[str]
    heavy: frozenset[str]
    heavy_bound: int

    def may_admit(self, tenant: str, batch: int, most: int) -> bool:
        if tenant in self.heavy and batch >= self.heavy_bound:
            return False
        return may_admit(self.shares.get(tenant, 0.0), self.running[tenant], batch >= most)


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
        hosts: HostSource | None = None,
        limiter: BatchLimiter | None = None,
    ) -> None:
        """`hosts`: where adapters' weights come from (the AdapterStore); needed once a request has an adapter.
        `limiter`: the cap on running requests of itl_slo_s (batch_limit.py)."""
        self.limits = limits
        self.pool = pool
        self.adapters = adapters
        self.block_size = pool.geometry.block_size
        self.policy = policy if policy is not None else FcfsPolicy()  # (an empty queue is falsy)
        self.book = book if book is not None else TenantBook()
        self.guard = guard if guard is not None else SloGuard(SloSettings())
        self.clock = clock  # what request arrival times are measured with
        self.limiter = limiter
        self.steps = StepClock()  # times steps for the totals, the guard's meter and the limiter
        self.step_totals = StepTotals()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.refusals: Counter[str] = Counter()  # SLO refusals by reason (slo.RefusalReason)
        self._steps_since_admission = 0
        self._admissions = 0
        self.reads = ReadAhead(hosts or _NoHosts(), limits.read_ahead, limits.read_ahead_bytes)
        self._bypassed: dict[Request, int] = {}  # requests passed over for want of room → admissions ahead of them
        # Under fair with itl_slo_s, each tenant's demand averaged in time: what its share of the cap follows.
        self.demand = DemandMeter() if limiter is not None and isinstance(self.policy, FairPolicy) else None
        # Under fair with itl_slo_s, the batch up to which heavy tenants are admitted while others have work.
        self.heavy_limiter = None
        if limiter is not None and self.demand is not None:
            target = HEAVY_TARGET * limiter.itl_slo_s
            self.heavy_limiter = PaceLimiter(target, limiter.max_num_seqs, "heavy tenants' running requests")
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
        now = self.clock()
        self._observe(self.steps.completed())
        if self._deadlines:
            self._refuse_late(out, now)
        budget = self._schedule_running(out, self.limits.max_batch_tokens)
        admitted = 0
        admission = not out.preempted and self._admission_due()
        if admission:
            admitted = self._admit_waiting(out, budget)
            if not out.seqs and not out.refused and out.reading and self.reads.pending():
                self.reads.wait(IDLE_READ_WAIT_S)  # nothing else to do: admit what the read brings, in this step
                admitted = self._admit_waiting(out, budget)
        self.policy.served(out.seqs)
        self._prefetch()
        self.steps.started(now, sum(s.num_tokens for s in out.seqs if s.num_tokens > 1), len(out.seqs))
        if self._deadlines and out.seqs:
            self.guard.meter.planned(now, admitted, admission, bool(self.policy))
        elif self._deadlines:
            self.guard.meter.idle()  # nothing runs this step (all refused, or every last token in flight)
        return out

    def _observe(self, steps: list[Step]) -> None:
        """Give the steps whose tokens came since the last plan to the guard's meter and the limiters."""
        for step in steps:
            if self._deadlines:
                self.guard.meter.observe(step)
            if self.limiter is not None:
                self.limiter.observe(step, len(self.running) >= self.max_running() and bool(self.policy))
            if self.heavy_limiter is not None:
                self.heavy_limiter.observe(step, len(self.running) >= self.heavy_limiter.cap and bool(self.policy))

    def step_done(self, device_s: float | None = None, graph: bool = False, copy_wait_s: float = 0.0) -> None:
        """The engine read the tokens of the oldest step launched; `device_s`: its time on the device, where
        timed there (step_clock.py); `graph`: whether it replayed a CUDA graph; `copy_wait_s`: how long the device
        waited ahead of it for adapter copies."""
        step = self.steps.finished(self.clock(), device_s)
        if step is not None:
            self.step_totals.add(step, graph, copy_wait_s)

    def max_running(self) -> int:
        """Requests that may run at once now: max_num_seqs, or less while itl_slo_s caps the batch."""
        return self.limits.max_num_seqs if self.limiter is None else min(self.limits.max_num_seqs, self.limiter.cap)

    def heavy_max_running(self) -> int:
        """Requests a heavy tenant may fill the batch up to while other tenants have work (slot_shares.py):
        max_running() unless fair with itl_slo_s keeps the heavy tenants' step target."""
        most = self.max_running()
        return most if self.heavy_limiter is None else min(most, self.heavy_limiter.cap)

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
        self._bypassed.pop(request, None)
        request.status = RequestStatus.FINISHED
        self.book.finished(request)
        if not self.has_work():
            self.steps.stop()  # no step until new work comes: that wait is not a step's time
            self.guard.meter.idle()

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
        """`n` KV pages for `request`, evicting unpinned adapters when that frees pages KV can use; None if not."""
        pages = self.pool.alloc(n, PageKind.KV, ("kv", request.request_id))
        if pages is None and self.pool.unified and self.adapters.evict(n):
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
        """Admit from the head of the policy's queue; returns how many were admitted. Requests passed over (module
        docstring) keep their place in the queue, ahead of the rest; admission stops after prefetch_adapters
        passed over for their copy (each may have started an adapter load), or MAX_PASSES in all."""
        passed_over: list[Request] = []
        blocked: list[Request] = []  # passed over for want of room: each admission behind them bypasses them
        may_pass = self.limits.admit_when_copied and bool(out.seqs)  # only while other work keeps the step busy
        copies, max_copies = 0, max(self.limits.prefetch_adapters, 1)
        admitted_count = out.reading = 0
        most = self.max_running()
        shares = self._slot_shares(most)
        limit = most if shares is None else self.limits.max_num_seqs  # shares let a tenant under its own past the cap
        while self.policy and budget > 0 and len(self.running) < limit:
            if copies >= max_copies or len(passed_over) >= MAX_PASSES:
                break
            request = self.policy.peek()
            if request is None:
                break
            if shares is not None and not shares.may_admit(request.tenant, len(self.running), most):
                assert isinstance(self.policy, FairPolicy)
                self.policy.hold(request.tenant)
                continue
            if self._deadlines and self._refuse_if_late(request, out):
                continue
            outcome = self._try_admit(request, may_pass, not passed_over, out)
            if outcome is None:
                continue  # refused: its adapter could not be read
            if outcome is Admission.ADMITTED:
                budget -= self._start(request, budget, out)
                admitted_count += 1
                if shares is not None:
                    shares.running[request.tenant] += 1
                for other in blocked:
                    self._bypassed[other] = self._bypassed.get(other, 0) + 1
                continue
            if outcome is Admission.NO_ROOM and self._bypassed.get(request, 0) >= self.limits.max_bypass:
                break  # bypassed enough (or bypass is off): wait for room at this request
            self.policy.set_aside(request)
            passed_over.append(request)
            copies += outcome is Admission.COPYING
            out.reading += outcome is Admission.READING
            if outcome is Admission.NO_ROOM:
                blocked.append(request)
        self.policy.put_back(passed_over)
        self._count_admissions(admitted_count)
        return admitted_count

    def _slot_shares(self, most: int) -> _Shares | None:
        """Under fair with itl_slo_s: the tenants' averaged demands brought up to date, and while more requests
        have work than the cap allows, their slot shares."""
        if self.demand is None:
            return None
        running = Counter(r.tenant for r in self.running)
        demands = running + Counter(self.policy.waiting_by_tenant())
        averages = self.demand.observe(self.clock(), demands)
        total = len(self.running) + len(self.policy)
        if total <= most:  # every request with work fits
            return self._flood_bound(demands, running, total, most)
        split = shares(most, demands, averages, self.book.weight)
        over = heavy(split, averages) | flooding(demands, self.book.weight)
        bound = most
        if self.heavy_limiter is not None and any(t not in over for t in demands):
            bound = min(most, self.heavy_limiter.cap)
        return _Shares(split, running, over, bound)

    def _flood_bound(self, demands: Counter[str], running: Counter[str], total: int, most: int) -> _Shares | None:
        """While every request with work (`total`) fits the cap but not the heavy tenants' cap: the floods of the
        moment bounded by the heavy cap, every other tenant free up to the cap (slot_shares.py; `flooding` never
        names every tenant); None when there is no flood."""
        if self.heavy_limiter is None or total <= self.heavy_limiter.cap:
            return None
        floods = flooding(demands, self.book.weight)
        if not floods:
            return None
        free = {tenant: float(most) for tenant in demands}
        return _Shares(free, running, floods, min(most, self.heavy_limiter.cap))

    def _try_admit(self, request: Request, may_pass: bool, head: bool, out: SchedulerOutput) -> Admission | None:
        """_admit, with a failed adapter read refusing the request (None)."""
        try:
            return self._admit(request, may_pass, head)
        except SloraError as exc:
            assert request.adapter is not None  # only an adapter's read raises here
            self.reads.forget(request.adapter)
            logger.warning("request %s refused: %s", request.request_id, exc)
            self._refuse(request, exc, out)
            return None

    def _start(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        """Run an admitted request from this step on; returns the tokens of the budget it takes."""
        self.policy.take(request)
        self._bypassed.pop(request, None)
        self.running.append(request)
        n = min(request.num_pending, budget)
        out.seqs.append(ScheduledSeq(request, n))
        return n

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

    def _refuse(self, request: Request, error: SloraError, out: SchedulerOutput) -> None:
        """Finish a waiting request "rejected": its SLO cannot be met (counted by reason), or its adapter's read
        failed."""
        logger.debug("%s", error)  # counted in the statistics; under overload there are many
        self.policy.remove(request)
        self._free(request)
        self._bypassed.pop(request, None)
        request.status = RequestStatus.FINISHED
        request.finish_reason = FinishReason.REJECTED
        self.book.finished(request)
        if isinstance(error, SloRefusedError):
            self.refusals[error.reason] += 1
        out.refused.append((request, error))

    def _admit(self, request: Request, may_pass: bool = False, head: bool = True) -> Admission:
        """Pin the request's adapter and allocate pages for all its tokens; on failure change nothing (an adapter
        made resident stays, unpinned). READING: its adapter is not in host memory yet (its read is started, when
        the read-ahead window has room or the request is the queue's `head`); COPYING (with `may_pass`): its
        adapter is resident but the copy into its pages is not issued yet; nothing pinned. Raises SloraError when
        its adapter's read failed."""
        if request.adapter is not None:
            resident = self.adapters.get(request.adapter.key)
            if resident is None:
                host = self.reads.host_copy(request.adapter, force=head)
                if host is None:
                    return Admission.READING
                self._check_fits(request, host)
                if not self._has_room(request, host.num_pages):
                    return Admission.NO_ROOM
                self.adapters.evict(host.num_pages)  # frees enough: _has_room counted what it can evict
                resident = self.adapters.load(host)
                if resident is None:
                    return Admission.NO_ROOM
                self.reads.forget(request.adapter)
            if may_pass and not resident.copy_issued:
                self.adapters.touch(resident)
                return Admission.COPYING
            self.adapters.pin(resident)
            request.resident = resident
        pages = self._alloc(self.pages_for(request.num_tokens), request)
        if pages is None:
            self._free(request)
            return Admission.NO_ROOM
        request.pages = pages
        request.status = RequestStatus.RUNNING
        return Admission.ADMITTED

    def _has_room(self, request: Request, adapter_pages: int) -> bool:
        """Whether the pool can take `request`'s KV and its adapter's `adapter_pages` now, evicting unpinned adapters.
        Asked before its adapter is loaded: a request whose KV does not fit yet must not evict adapters that others
        were given, nor load its own, since under pressure admission tries it again and again (each try would copy
        an adapter in and the next request's try would evict it)."""
        kv_pages = self.pages_for(request.num_tokens)
        if self.pool.unified:  # KV and adapters take from the same free pages
            return self.adapters.can_free(kv_pages + adapter_pages)
        # In a reserved region evicting adapters frees no KV page.
        return kv_pages <= self.pool.num_free_for(PageKind.KV) and self.adapters.can_free(adapter_pages)

    def never_fits(self, kv_pages: int, adapter_pages: int) -> str | None:
        """Why a request holding `kv_pages` of KV and an adapter of `adapter_pages` at once could never be admitted,
        even into an empty pool (which part of the pool is too small, and its pages), or None when it could."""
        pool = self.pool
        if pool.unified:
            return f"the pool has {pool.num_pages}" if kv_pages + adapter_pages > pool.num_pages else None
        adapter_region, kv_region = pool.num_pages_for(PageKind.ADAPTER), pool.num_pages_for(PageKind.KV)
        if adapter_pages > adapter_region:
            return f"the adapter region has {adapter_region} of the pool's {pool.num_pages} (adapter_region_fraction)"
        if kv_pages > kv_region:
            return (
                f"the KV region has {kv_region} of the pool's {pool.num_pages} (the rest of adapter_region_fraction's)"
            )
        return None

    def _check_fits(self, request: Request, host: HostAdapter) -> None:
        """Raise AdapterError if the adapter read is too large for the pool with the request's KV (its files were
        rewritten since the request was checked against its ref): it could never be admitted."""
        kv = self.pages_for(request.num_prompt + request.sampling.max_tokens)
        why = self.never_fits(kv, host.num_pages)
        if why is not None:
            raise AdapterError(
                f"adapter {host.name!r} now needs {host.num_pages} pages (its files changed since the request was "
                f"taken in): with the request's KV, {host.num_pages + kv} pages, but {why}"
            )

    def _prefetch(self) -> None:
        """Ahead of admission, in the policy's order: copy the adapters of the next waiting requests (the first
        prefetch_adapters distinct ones) into free pages, keeping a page per running request and the request's own
        KV pages (in the unified pool, where their KV takes from the same pages), and start reading those of the first
        read_ahead into host memory (read_ahead.py bounds what the reads hold)."""
        reserve = len(self.running) if self.pool.unified else 0
        seen: set[tuple[str, int]] = set()
        ahead: list[ResidentAdapter] = []
        window = max(self.limits.prefetch_adapters, self.limits.read_ahead)
        for request in itertools.islice(self.policy.upcoming(), PREFETCH_SCAN):
            if len(seen) >= window:
                break
            ref = request.adapter
            if ref is None or ref.key in seen:
                continue
            seen.add(ref.key)
            resident = self.adapters.get(ref.key)
            if resident is None and len(seen) <= self.limits.prefetch_adapters:
                resident = self._copy_ahead(ref, reserve + self._own_kv(request))
            elif resident is None:
                self._read_ahead(ref)
            if resident is not None:
                ahead.append(resident)
        # Touched from the back of the queue to its head, so that eviction (least recently used first) takes the
        # adapter needed last first, and the head's last of all.
        for resident in reversed(ahead):
            self.adapters.touch(resident)
        self.reads.keep_only(seen)

    def _own_kv(self, request: Request) -> int:
        """The pages an adapter copied ahead for `request` leaves free for the request's own KV: in the unified pool,
        an adapter copied into pages its request's KV then lacks is evicted by the running requests' growth before
        that request can be admitted, and copied again later."""
        return self.pages_for(request.num_tokens) if self.pool.unified else 0

    def _copy_ahead(self, ref: AdapterRef, reserve: int) -> ResidentAdapter | None:
        """`ref`'s adapter made resident in free pages (leaving `reserve`) if host memory holds it, else None
        (its read started)."""
        host = self._read_ahead(ref)
        if host is None or self.pool.num_free_for(PageKind.ADAPTER) - host.num_pages < reserve:
            return None
        resident = self.adapters.load(host)
        if resident is not None:
            self.reads.forget(ref)
        return resident

    def _read_ahead(self, ref: AdapterRef) -> HostAdapter | None:
        """`ref`'s adapter if host memory holds it, else None after starting its read (a failed read is left for
        admission to report)."""
        try:
            return self.reads.host_copy(ref)
        except SloraError:
            return None


class _NoHosts:
    """The host source of a scheduler built without one: no request of it may have an adapter."""

    def lookup(self, ref: AdapterRef) -> HostAdapter | None:
        raise RuntimeError(f"adapter {ref.name!r}: this scheduler has no adapter store")

    def fetch(self, ref: AdapterRef) -> Future[HostAdapter]:
        raise RuntimeError(f"adapter {ref.name!r}: this scheduler has no adapter store")
