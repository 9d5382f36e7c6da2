"""The scheduler stepped without a model: each planned seq computes its tokens, a seq that reaches its last token
samples one (token 0), a request with max_tokens outputs finishes. Thousands of steps a second, for properties.

Service is counted as the VTC paper counts it: a request's prompt in the step of its first admission, each sampled
token in its step, weighted by (prompt_cost, output_cost) and divided by the tenant's weight.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from slora.backend.adapters.host_adapter import AdapterRef, HostAdapter
from slora.backend.engine.batch_limit import BatchLimiter
from slora.backend.engine.request import Request
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.engine.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from slora.backend.engine.scheduling_policy import make_policy
from slora.backend.engine.slo import SloGuard, SloSettings
from slora.backend.engine.tenants import TenantBook
from slora.backend.memory.adapter_cache import AdapterCache
from slora.backend.memory.page_pool import PageKind, PagePool, PoolGeometry

BLOCK = 4  # tokens per page
GEOMETRY = PoolGeometry(num_layers=1, block_size=BLOCK, num_kv_heads=1, head_dim=2)


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def make_request(rid: str, tenant: str, prompt: int, output: int, arrival: float = 0.0, priority: int = 0) -> Request:
    sampling = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    return Request(rid, [1] * prompt, prompt, sampling, tenant=tenant, arrival_time=arrival, priority=priority)


@dataclass
class Sim:
    scheduler: Scheduler
    clock: FakeClock
    step_s: float = 0.01
    service: dict[str, list[float]] = field(default_factory=dict)  # tenant → service in each step
    backlogged: list[set[str]] = field(default_factory=list)  # tenants with requests waiting after each plan
    plans: list[SchedulerOutput] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    prompt_cost: float = 1.0
    output_cost: float = 2.0
    pace: Callable[[int], float] | None = None  # a step's seconds from its batch size (default: step_s)
    durations: list[float] = field(default_factory=list)  # each step's seconds

    @property
    def steps(self) -> int:
        return len(self.plans)

    def add(self, request: Request) -> None:
        self.service.setdefault(request.tenant, [0.0] * self.steps)
        self.scheduler.add(request)

    def step(self) -> SchedulerOutput:
        plan = self.scheduler.schedule()
        served = self._service(plan)
        for tenant, values in self.service.items():
            values.append(served.get(tenant, 0.0))
        for seq in plan.seqs:
            seq.request.num_computed += seq.num_tokens
        for seq in plan.seqs:
            request = seq.request
            if request.num_computed == request.num_tokens:
                request.token_ids.append(0)
                if request.num_output >= request.sampling.max_tokens:
                    self.scheduler.release(request)
                    self.finished.append(request)
        self.scheduler.pool.check_integrity()
        self.backlogged.append({r.tenant for r in self.scheduler.waiting})
        self.plans.append(plan)
        seconds = self.step_s if self.pace is None else self.pace(len(plan.seqs))
        self.durations.append(seconds)
        self.clock.now += seconds
        if plan.seqs:
            self.scheduler.step_done()  # the step's tokens, at its end
        return plan

    def run(self, until: Callable[[], bool] | None = None, max_steps: int = 20_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_work() or (until is not None and until()):
                return
            self.step()
        raise AssertionError("the scheduler did not finish (starvation or a deadlock)")

    def _service(self, plan: SchedulerOutput) -> dict[str, float]:
        book = self.scheduler.book
        out: dict[str, float] = {}
        for seq in plan.seqs:
            r = seq.request
            cost = 0.0
            if r.num_computed == 0 and r.num_preemptions == 0:  # first admission: its prompt
                cost += self.prompt_cost * r.num_prompt
            if seq.num_tokens == r.num_pending:  # it samples a token
                cost += self.output_cost
            out[r.tenant] = out.get(r.tenant, 0.0) + cost / book.weight(r.tenant)
        return out

    def max_service_gap(self, f: str, g: str) -> float:
        """The largest |W_f - W_g| over intervals of steps during which both tenants stayed backlogged."""
        gap = 0.0
        diff = 0.0
        low = high = None
        for k, (a, b) in enumerate(zip(self.service[f], self.service[g])):
            both = f in self.backlogged[k] and g in self.backlogged[k]
            if not both:
                low = high = None
                diff += a - b
                continue
            if low is None or high is None:
                low = high = diff
            diff += a - b
            low, high = min(low, diff), max(high, diff)
            gap = max(gap, high - low)
        return gap


def make_sim(
    policy: str = "fcfs",
    pages: int = 400,
    max_batch_tokens: int = 4096,
    max_num_seqs: int = 8,
    weights: dict[str, float] | None = None,
    settings: SloSettings | None = None,
    aging_rate: float = 1.0,
    limiter: BatchLimiter | None = None,
    admit_interval: int = 1,
) -> Sim:
    pool = PagePool(GEOMETRY, pages, torch.float32, torch.device("cpu"))
    book = TenantBook(weights)
    clock = FakeClock()
    limits = SchedulerLimits(max_batch_tokens, max_num_seqs, prefetch_adapters=0, admit_interval=admit_interval)
    scheduler = Scheduler(limits, pool, AdapterCache(pool), make_policy(policy, book, 1.0, 2.0, aging_rate), book,
                          SloGuard(settings or SloSettings()), clock, limiter=limiter)  # fmt: skip
    return Sim(scheduler, clock)


def kv_tokens(sim: Sim) -> int:
    return sim.scheduler.pool.count(PageKind.KV) * BLOCK


_ids = itertools.count()


def flood(sim: Sim, tenant: str, n: int, prompt: tuple[int, int], output: tuple[int, int], seed: int) -> None:
    """Add `n` requests of `tenant` now, lengths drawn uniformly from the ranges (inclusive)."""
    rng = random.Random(seed)
    for i in range(n):
        rid = f"{tenant}-{next(_ids)}"
        arrival = sim.clock.now + i * 1e-7  # in order, as a real clock would have them
        sim.add(make_request(rid, tenant, rng.randint(*prompt), rng.randint(*output), arrival=arrival))


class Hosts:
    """Every adapter already in host memory (the store's side of admission is not what the sim is about)."""

    def __init__(self, pages: dict[str, int]) -> None:
        self.adapters = {name: host_adapter(name, n) for name, n in pages.items()}

    def lookup(self, ref: AdapterRef) -> HostAdapter | None:
        return self.adapters[ref.name]

    def fetch(self, ref: AdapterRef) -> Future[HostAdapter]:
        future = Future[HostAdapter]()
        future.set_result(self.adapters[ref.name])
        return future


def host_adapter(name: str, pages: int) -> HostAdapter:
    """A rank-1 adapter whose image takes `pages` pages of GEOMETRY."""
    empty = torch.zeros(0, dtype=torch.int64)
    image = torch.zeros((1, pages, GEOMETRY.page_elems))
    return HostAdapter(name, Path(name), (1,) + (0,) * 6, (1.0,) + (0.0,) * 6, image, empty, empty)
