"""Admission that favours requests whose adapter is resident, by bounded bypass: a request the pool has no room for
is passed over (keeping its place) for at most max_bypass admissions behind it, then admission waits at it. Under
every policy and a flood that never stops, nothing starves; with max_bypass 0 the order is strict."""

from __future__ import annotations

import pytest
import torch

from slora.backend.adapters.host_adapter import HostAdapter
from slora.backend.engine.request import Request
from slora.backend.engine.scheduler import Scheduler, SchedulerLimits
from slora.backend.engine.scheduling_policy import make_policy
from slora.backend.engine.slo import SloGuard, SloSettings
from slora.backend.engine.tenants import TenantBook
from slora.backend.memory.adapter_cache import AdapterCache
from slora.backend.memory.page_pool import PagePool
from tests.engine.scheduler_sim import GEOMETRY, FakeClock, Hosts, Sim, make_request


def _sim(policy: str, max_bypass: int, pool_pages: int, hosts: Hosts, max_num_seqs: int = 16) -> Sim:
    pool = PagePool(GEOMETRY, pool_pages, torch.float32, torch.device("cpu"))
    book = TenantBook()
    limits = SchedulerLimits(4096, max_num_seqs, prefetch_adapters=0, max_bypass=max_bypass)
    clock = FakeClock()
    scheduler = Scheduler(limits, pool, AdapterCache(pool), make_policy(policy, book, 1.0, 2.0, 1.0), book,
                          SloGuard(SloSettings()), clock, hosts=hosts)  # fmt: skip
    return Sim(scheduler, clock)


def _request(sim: Sim, rid: str, tenant: str, adapter: HostAdapter, prompt: int, output: int) -> Request:
    request = make_request(rid, tenant, prompt, output, arrival=sim.clock.now)
    request.adapter = adapter.ref
    sim.add(request)
    return request


def _admitted_ahead(sim: Sim, big: Request) -> list[str]:
    """Requests that arrived after `big` and were admitted before it."""
    first: dict[str, int] = {}
    arrival: dict[str, float] = {}
    for step, plan in enumerate(sim.plans):
        for seq in plan.seqs:
            first.setdefault(seq.request.request_id, step)
            arrival[seq.request.request_id] = seq.request.arrival_time
    return [r for r, step in first.items() if arrival[r] > big.arrival_time and step < first[big.request_id]]


def _flood_with_a_big_one(sim: Sim, hosts: Hosts, steps: int) -> Request:
    """Small requests of a resident adapter keep coming, every step, for `steps` steps; a request for an adapter
    as large as most of the pool arrives after the first few."""
    small, big_adapter = hosts.adapters["small"], hosts.adapters["big"]
    big: Request | None = None
    for step in range(steps):
        for k in range(2):
            _request(sim, f"s{step}-{k}", "flood", small, prompt=8, output=6)
        if step == 3:
            big = _request(sim, "big", "lonely", big_adapter, prompt=8, output=2)
        sim.step()
    assert big is not None
    sim.run()
    return big


@pytest.mark.parametrize("policy", ["fcfs", "fair", "priority"])
@pytest.mark.parametrize("max_bypass", [0, 4, 16])
def test_nothing_starves_under_a_flood_that_never_stops(policy: str, max_bypass: int) -> None:
    hosts = Hosts({"small": 2, "big": 40})
    sim = _sim(policy, max_bypass, pool_pages=60, hosts=hosts)
    big = _flood_with_a_big_one(sim, hosts, steps=400)
    assert big in sim.finished, "the big request starved"
    ahead = _admitted_ahead(sim, big)
    if policy == "fcfs":
        assert len(ahead) <= max_bypass, ahead  # bypass is bounded ...
    if max_bypass and policy == "fcfs":
        assert ahead, "... and used: the resident adapter's requests went ahead while there was no room"


def test_resident_adapters_run_while_the_head_waits_for_room() -> None:
    """A request the pool cannot take now does not stop requests of a resident adapter behind it (bypass on), and
    does with bypass off (the order before bypass)."""
    for max_bypass, admitted in ((8, {"head", "r1", "r2"}), (0, {"head"})):
        hosts = Hosts({"small": 1, "big": 20})
        sim = _sim("fcfs", max_bypass, pool_pages=24, hosts=hosts)
        _request(sim, "head", "t", hosts.adapters["small"], prompt=8, output=50)  # runs, holds the small adapter
        sim.step()
        big = _request(sim, "big", "t", hosts.adapters["big"], prompt=8, output=1)  # 20 + 2 pages: no room
        for rid in ("r1", "r2"):
            _request(sim, rid, "t", hosts.adapters["small"], prompt=4, output=1)
        planned = {seq.request.request_id for seq in sim.step().seqs}
        assert planned == admitted and big in sim.scheduler.waiting
        assert list(sim.scheduler.waiting)[0] is big, "the passed-over request keeps its place"
