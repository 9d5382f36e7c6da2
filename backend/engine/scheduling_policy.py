"""Scheduling policies: the waiting queue, in the order a policy admits from it. One small class per policy.

    fcfs      arrival order; a preempted request goes back to the head. The engine's order before policies.
    fair      the Virtual Token Counter of "Fairness in Serving Large Language Models" (Sheng et al., OSDI 2024):
              a counter per tenant of the weighted tokens it was served, the backlogged tenant with the least
              counter admitted next, a newly backlogged tenant's counter lifted so that idle time earns no credit.
    priority  higher `priority` first, aged so that low priority never starves.

The scheduler (scheduler.py) owns admission, pages and preemption; a policy only chooses. Its calls, per step:
while admitting `peek` → `take` (admitted), or `set_aside` … `put_back` (passed over this step: its adapter copy
is not issued yet), and under fair `hold` (a tenant at its slot share under the itl_slo_s cap, slot_shares.py,
until `put_back`); `victim` when the pool is full (which running request to preempt); `served` (the step's plan,
for service counters). Off the step: `push` (arrival), `push_preempted`, `remove` (abort or SLO refusal),
`upcoming` (adapter prefetch) and `positions` (how many admissions come before each waiting request: the SLO
estimate, slo.py). Running requests stay in admission order under every policy (the token budget goes to them
in that order), so that consecutive decode steps keep one batch order (executor/decode_batch.py builds each from
the one before).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from abc import ABC, abstractmethod
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator

from slora.backend.engine.request import Request
from slora.backend.engine.tenants import TenantBook
from slora.backend.errors import InvalidRequestError
from slora.backend.executor.batch import ScheduledSeq

POLICIES = ("fcfs", "fair", "priority")
MAX_PRIORITY = 1_000_000
UPCOMING = 32  # fair / priority: waiting requests (or tenants) looked at for adapter prefetch


class SchedulingPolicy(ABC):
    """The waiting queue of one policy (see the module docstring for when each method is called)."""

    name: str

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Every waiting request (fcfs: in admission order; others: in no promised order)."""

    @abstractmethod
    def __contains__(self, request: object) -> bool: ...

    @abstractmethod
    def push(self, request: Request) -> None:
        """A new request arrives."""

    @abstractmethod
    def push_preempted(self, request: Request) -> None:
        """A running request was preempted and waits again."""

    @abstractmethod
    def peek(self) -> Request | None:
        """The request to admit next, or None when nothing waits."""

    @abstractmethod
    def take(self, request: Request) -> None:
        """`request`, the one peek returned, was admitted: it leaves the queue."""

    @abstractmethod
    def set_aside(self, request: Request) -> None:
        """`request`, the one peek returned, is passed over for this step; put_back returns it to its place."""

    @abstractmethod
    def put_back(self, requests: list[Request]) -> None:
        """Return requests set aside (in the order they were set aside) to where they were."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """`request` leaves the queue without being admitted (abort, refusal)."""

    def victim(self, candidates: list[Request]) -> Request:
        """The running request to preempt among `candidates` (in admission order): by default the last admitted."""
        return candidates[-1]

    def served(self, seqs: list[ScheduledSeq]) -> None:  # noqa: B027 (a hook: most policies need nothing here)
        """A step was planned with these seqs (default: nothing to count)."""

    def forget_idle(self, busy: set[str]) -> None:  # noqa: B027 (a hook: most policies need nothing here)
        """Drop state kept for tenants neither waiting nor in `busy`, where that loses nothing that matters."""

    def counter(self, tenant: str) -> float | None:
        """The tenant's service counter, for policies that keep one."""
        return None

    @abstractmethod
    def upcoming(self) -> Iterable[Request]:
        """Waiting requests in about the order they will be admitted (at least the first few)."""

    @abstractmethod
    def positions(self) -> Iterator[tuple[Request, float]]:
        """Every waiting request with an estimate of how many admissions will come before its own."""


class FcfsPolicy(SchedulingPolicy):
    """First come, first served; a preempted request goes back to the head of the queue."""

    name = "fcfs"

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __contains__(self, request: object) -> bool:
        return request in self._queue

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def push_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request | None:
        return self._queue[0] if self._queue else None

    def take(self, request: Request) -> None:
        self._pop(request)

    def set_aside(self, request: Request) -> None:
        self._pop(request)

    def put_back(self, requests: list[Request]) -> None:
        self._queue.extendleft(reversed(requests))

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def upcoming(self) -> Iterable[Request]:
        return self._queue

    def positions(self) -> Iterator[tuple[Request, float]]:
        return ((request, float(i)) for i, request in enumerate(self._queue))

    def _pop(self, request: Request) -> None:
        if self._queue[0] is request:
            self._queue.popleft()
        else:
            self._queue.remove(request)


class PriorityPolicy(SchedulingPolicy):
    """Higher `priority` first, arrival order among equals; waiting earns `aging_rate` priority levels a second.

    A request of priority p that has waited w seconds ranks as p + aging_rate·w, so a newer request of priority
    q > p goes ahead of it for (q - p) / aging_rate seconds at most: low priority never starves. Every waiting
    request ages at the same rate, so the ranking never changes while they wait: p + a·(now - arrival) orders as
    p - a·arrival, a key fixed at arrival, and the queue is a heap on it. A preempted request keeps its key (it
    has aged since it arrived); the running request with the lowest is preempted first.
    """

    name = "priority"

    def __init__(self, aging_rate: float) -> None:
        self.aging_rate = aging_rate
        self._heap: list[tuple[float, float, int, Request]] = []  # (key, arrival, entry id, request)
        self._live: dict[Request, int] = {}  # waiting request → its heap entry's id (other entries are stale)
        self._ids = itertools.count()

    def key(self, request: Request) -> tuple[float, float]:
        """Smaller first: minus the effective priority, up to a constant (a·now) shared by every request."""
        return self.aging_rate * request.arrival_time - request.priority, request.arrival_time

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._live)

    def __contains__(self, request: object) -> bool:
        return request in self._live

    def push(self, request: Request) -> None:
        entry = next(self._ids)
        self._live[request] = entry
        heapq.heappush(self._heap, (*self.key(request), entry, request))
        if len(self._heap) > 2 * len(self._live) + 64:  # stale entries of removed requests: drop them
            self._heap = [e for e in self._heap if self._live.get(e[3]) == e[2]]
            heapq.heapify(self._heap)

    def push_preempted(self, request: Request) -> None:
        self.push(request)

    def peek(self) -> Request | None:
        while self._heap and self._live.get(self._heap[0][3]) != self._heap[0][2]:
            heapq.heappop(self._heap)
        return self._heap[0][3] if self._heap else None

    def take(self, request: Request) -> None:
        self.remove(request)

    def set_aside(self, request: Request) -> None:
        self.remove(request)

    def put_back(self, requests: list[Request]) -> None:
        for request in requests:
            self.push(request)

    def remove(self, request: Request) -> None:
        del self._live[request]  # its heap entry goes stale; peek drops it when it reaches the top

    def victim(self, candidates: list[Request]) -> Request:
        """The lowest effective priority; the last admitted among equals."""
        return max(reversed(candidates), key=self.key)

    def upcoming(self) -> Iterable[Request]:
        """The first UPCOMING waiting requests (popped off the heap, then pushed back)."""
        entries: list[tuple[float, float, int, Request]] = []
        while len(entries) < UPCOMING and self.peek() is not None:
            entries.append(heapq.heappop(self._heap))
        for entry in entries:
            heapq.heappush(self._heap, entry)
        return [e[3] for e in entries]

    def positions(self) -> Iterator[tuple[Request, float]]:
        return ((e[3], float(i)) for i, e in enumerate(sorted(self._live_entries())))

    def _live_entries(self) -> Iterator[tuple[float, float, int, Request]]:
        return (e for e in self._heap if self._live.get(e[3]) == e[2])


class FairPolicy(SchedulingPolicy):
    """VTC: the backlogged tenant with the least counter of weighted service is admitted next.

    Counters (in tokens, divided by the tenant's weight): an admission adds prompt_cost × its prompt, and every
    token a step samples adds output_cost, both as the paper's cost function counts them. A tenant is backlogged
    while it has requests waiting. When a tenant becomes backlogged its counter is lifted to the least counter of
    the backlogged tenants (to the counter of the tenant that last left the queue when none is backlogged), so a
    tenant cannot save credit by staying idle. Then two tenants backlogged over any interval get weighted services
    within 2·max(prompt_cost·L, output_cost·M) of each other, L the longest prompt and M the most tokens a running
    batch holds (the paper's bound: a tenant's running requests can sample at most M tokens before they free their
    pages), and requests wait only while the batch, the budget or the pool is full (it is work-conserving).

    What the paper leaves open, on an engine of chunked prefill and preemption: the prompt is counted once, at its
    first admission, whatever the chunks it is computed in; a preempted request's recomputation is the engine's
    loss, not service, so its readmission counts nothing and does not lift its tenant (it goes back to the head of
    its tenant's queue). When the pool is full, a request of the most-served running tenant is preempted first.
    """

    name = "fair"
    MAX_IDLE_COUNTERS = 4096

    def __init__(self, book: TenantBook, prompt_cost: float, output_cost: float) -> None:
        self.book = book
        self.prompt_cost = prompt_cost
        self.output_cost = output_cost
        self.counters: dict[str, float] = {}
        self._queues: dict[str, deque[Request]] = {}  # backlogged tenants only (no empty queue)
        self._heap: list[tuple[float, float, str]] = []  # (counter, head's arrival, tenant); stale entries too
        self._keys: dict[str, tuple[float, float]] = {}  # each backlogged tenant's live heap key
        self._last_left: str | None = None
        self._size = 0
        self._held: set[str] = set()  # tenants passed over for this admission round (hold)

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain.from_iterable(self._queues.values())

    def __contains__(self, request: object) -> bool:
        queue = self._queues.get(getattr(request, "tenant", ""))
        return queue is not None and request in queue

    def backlogged(self) -> list[str]:
        return list(self._queues)

    def push(self, request: Request) -> None:
        if request.tenant not in self._queues:
            self._lift(request.tenant)
        self._enqueue(request, front=False)

    def push_preempted(self, request: Request) -> None:
        self.counters.setdefault(request.tenant, 0.0)
        self._enqueue(request, front=True)

    def peek(self) -> Request | None:
        tenant = self._least()
        return self._queues[tenant][0] if tenant is not None else None

    def take(self, request: Request) -> None:
        tenant = request.tenant
        if request.num_preemptions == 0:  # a first admission: its prompt is served now
            self._charge(tenant, self.prompt_cost * request.num_prompt)
        if self._dequeue(request):
            self._last_left = tenant

    def set_aside(self, request: Request) -> None:
        self._dequeue(request)

    def put_back(self, requests: list[Request]) -> None:
        """Also ends the holds of this admission round."""
        for request in reversed(requests):
            self._enqueue(request, front=True)
        for tenant in self._held:
            if tenant in self._queues:
                self._rekey(tenant)
        self._held.clear()

    def hold(self, tenant: str) -> None:
        """Pass over all of `tenant`'s waiting requests until put_back (it is at its slot share: slot_shares.py)."""
        self._keys.pop(tenant, None)  # its heap entries go stale: _least skips them
        self._held.add(tenant)

    def waiting_by_tenant(self) -> dict[str, int]:
        return {tenant: len(queue) for tenant, queue in self._queues.items()}

    def remove(self, request: Request) -> None:
        self._dequeue(request)

    def served(self, seqs: list[ScheduledSeq]) -> None:
        sampled: dict[str, int] = defaultdict(int)
        for seq in seqs:
            if seq.num_tokens == seq.request.num_pending:  # the step reaches its last token: it samples one
                sampled[seq.request.tenant] += 1
        for tenant, n in sampled.items():
            self._charge(tenant, self.output_cost * n)

    def counter(self, tenant: str) -> float | None:
        return self.counters.get(tenant)

    def victim(self, candidates: list[Request]) -> Request:
        """A request of the most-served tenant; its last admitted."""
        counters = self.counters
        return max(reversed(candidates), key=lambda r: counters.get(r.tenant, 0.0))

    def forget_idle(self, busy: set[str]) -> None:
        """Past MAX_IDLE_COUNTERS counters, drop those of idle tenants at or below the least backlogged counter:
        a tenant that comes back is lifted to at least that counter anyway."""
        floor_tenant = self._least()
        if len(self.counters) <= self.MAX_IDLE_COUNTERS or floor_tenant is None:
            return
        floor = self.counters[floor_tenant]
        self.counters = {t: c for t, c in self.counters.items() if t in self._queues or t in busy or c > floor}

    def upcoming(self) -> Iterable[Request]:
        """The queues of the least-served backlogged tenants, least first (popped off the heap, then pushed back)."""
        tenants: list[str] = []
        while len(tenants) < UPCOMING and (tenant := self._least()) is not None:
            heapq.heappop(self._heap)
            if tenant not in tenants:  # a live key can sit in the heap twice (a head set aside, then put back)
                tenants.append(tenant)
        for tenant in tenants:
            heapq.heappush(self._heap, (*self._keys[tenant], tenant))
        return itertools.chain.from_iterable(self._queues[t] for t in tenants)

    def positions(self) -> Iterator[tuple[Request, float]]:
        """Admissions before the j-th waiting request of tenant t, counting each backlogged tenant u as admitted in
        proportion to its weight while it has requests: F((j + 1) / w_t) - 1, F(x) = Σ_u min(len_u, x·w_u).
        (Counters of backlogged tenants stay within the bound of one another, so the weights decide the shares.)"""
        shares = _Shares([(len(q), self.book.weight(t)) for t, q in self._queues.items()])
        for tenant, queue in self._queues.items():
            weight = self.book.weight(tenant)
            for j, request in enumerate(queue):
                yield request, shares.admitted_within((j + 1) / weight) - 1.0

    # ---- counters and the tenants' heap ------------------------------------------------------------------------

    def _lift(self, tenant: str) -> None:
        """`tenant` becomes backlogged: no lower than the least backlogged counter (or than the last to leave)."""
        least = self._least()
        reference = least if least is not None else self._last_left
        floor = self.counters.get(reference, 0.0) if reference is not None else 0.0
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def _charge(self, tenant: str, cost: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.book.weight(tenant)
        if tenant in self._queues:
            self._rekey(tenant)

    def _least(self) -> str | None:
        """The backlogged tenant with the least counter (the earliest head request among equals)."""
        while self._heap:
            counter, arrival, tenant = self._heap[0]
            if self._keys.get(tenant) == (counter, arrival):
                return tenant
            heapq.heappop(self._heap)  # stale: its tenant's counter or head changed, or it left the queue
        return None

    def _rekey(self, tenant: str) -> None:
        key = (self.counters[tenant], self._queues[tenant][0].arrival_time)
        if self._keys.get(tenant) != key:
            self._keys[tenant] = key
            heapq.heappush(self._heap, (*key, tenant))
        if len(self._heap) > 2 * len(self._keys) + 64:
            self._heap = [(*k, t) for t, k in self._keys.items()]
            heapq.heapify(self._heap)

    def _enqueue(self, request: Request, front: bool) -> None:
        queue = self._queues.get(request.tenant)
        if queue is None:
            queue = self._queues[request.tenant] = deque()
        if front:
            queue.appendleft(request)
        else:
            queue.append(request)
        self._size += 1
        self._rekey(request.tenant)

    def _dequeue(self, request: Request) -> bool:
        """Take `request` out of its tenant's queue; True when that leaves the tenant with nothing waiting."""
        queue = self._queues[request.tenant]
        if queue[0] is request:
            queue.popleft()
        else:
            queue.remove(request)
        self._size -= 1
        if queue:
            self._rekey(request.tenant)
            return False
        del self._queues[request.tenant]
        self._keys.pop(request.tenant, None)  # (none while held)
        return True


class _Shares:
    """F(x) = Σ_u min(len_u, x·w_u) over (len_u, w_u) pairs, in O(log n) per x after one sort."""

    def __init__(self, queues: list[tuple[int, float]]) -> None:
        ordered = sorted(queues, key=lambda q: q[0] / q[1])
        self._ratios = [n / w for n, w in ordered]  # x at which queue u is exhausted
        self._done = list(itertools.accumulate((n for n, _ in ordered), initial=0))  # Σ len of exhausted queues
        self._rest = list(itertools.accumulate((w for _, w in reversed(ordered)), initial=0.0))[::-1]  # Σ w after

    def admitted_within(self, x: float) -> float:
        k = bisect.bisect_right(self._ratios, x)
        return self._done[k] + x * self._rest[k]


def check_priority(priority: object) -> int:
    """A request's `priority`; raises InvalidRequestError naming the field."""
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > MAX_PRIORITY:
        raise InvalidRequestError(f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {priority!r}")
    return priority


def make_policy(
    name: str, book: TenantBook, prompt_cost: float, output_cost: float, aging_rate: float
) -> SchedulingPolicy:
    if name == "fcfs":
        return FcfsPolicy()
    if name == "fair":
        return FairPolicy(book, prompt_cost, output_cost)
    if name == "priority":
        return PriorityPolicy(aging_rate)
    raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {name!r}")
