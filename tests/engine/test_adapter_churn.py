"""Adapter copies under pool pressure: admission and prefetch copy an adapter into the pool only for a request that
can run with it, so that with more requests waiting than the pool holds, copies stay near admissions instead of
an adapter per try (a request passed over for want of KV room used to load its adapter, evicting the one copied
for the request tried before it), in the unified pool and with a reserved adapter region."""

from __future__ import annotations

import random

import pytest
import torch

from slora.backend.engine.request import Request
from slora.backend.engine.scheduler import Scheduler, SchedulerLimits
from slora.backend.engine.scheduling_policy import make_policy
from slora.backend.engine.slo import SloGuard, SloSettings
from slora.backend.engine.tenants import TenantBook
from slora.backend.memory.adapter_cache import AdapterCache
from slora.backend.memory.page_pool import PageKind, PagePool
from tests.engine.scheduler_sim import GEOMETRY, FakeClock, Hosts, Sim, make_request

REGION = {"unified": None, "region": 0.25}
SIZES = (17, 9, 5, 3)  # pages of S2's ranks 64/32/16/8, as on the GPU's 16-token pages of a 7B model


def _sim(hosts: Hosts, pages: int, region: float | None, max_num_seqs: int, prefetch: int = 8) -> Sim:
    pool = PagePool(
        GEOMETRY, pages, torch.float32, torch.device("cpu"), None if region is None else int(pages * region)
    )
    book = TenantBook()
    limits = SchedulerLimits(2048, max_num_seqs, prefetch_adapters=prefetch, admit_interval=2, max_bypass=8)
    clock = FakeClock()
    scheduler = Scheduler(limits, pool, AdapterCache(pool), make_policy("fcfs", book, 1.0, 2.0, 1.0), book,
                          SloGuard(SloSettings()), clock, hosts=hosts)  # fmt: skip
    return Sim(scheduler, clock)


def _add(sim: Sim, hosts: Hosts, rid: str, adapter: str, prompt: int, output: int) -> Request:
    request = make_request(rid, adapter, prompt, output, arrival=sim.clock.now)
    request.adapter = hosts.adapters[adapter].ref
    sim.add(request)
    return request


def _run_counting_admissions(sim: Sim) -> int:
    """Run to the end; returns the steps' requests computed from their first token (first admissions and those
    after a preemption)."""
    admissions = 0
    while sim.scheduler.has_work():
        plan = sim.step()
        admissions += sum(s.request.num_computed == s.num_tokens for s in plan.seqs)
    return admissions


@pytest.mark.parametrize("mode", REGION)
def test_copies_stay_near_admissions_under_pressure(mode: str) -> None:
    """S-LoRA's ablation in small: a burst of long requests, each of its own S2-sized adapter, far more than the
    pool holds (perf/RESULTS.md, session 32, has what this burst and the GPU's copied before)."""
    hosts = Hosts({f"a{i}": SIZES[i % 4] for i in range(2000)})
    sim = _sim(hosts, 1536, REGION[mode], max_num_seqs=48)
    rng = random.Random(1)
    for i in range(100):
        _add(sim, hosts, f"r{i}", f"a{rng.randrange(2000)}", rng.randint(64, 255), rng.randint(64, 255))
    admissions = _run_counting_admissions(sim)
    cache = sim.scheduler.adapters
    assert len(sim.finished) == 100 and sim.scheduler.num_preemptions > 0, "the pool was meant to be short"
    assert cache.loads <= 1.5 * admissions, (cache.loads, admissions)
    assert sim.scheduler.pool.count(PageKind.KV) == 0, "every KV page back"


@pytest.mark.parametrize("mode", REGION)
def test_a_request_without_kv_room_moves_no_adapter(mode: str) -> None:
    """The head asks for more KV than the pool can give while others run: trying it leaves every resident adapter
    where it was and copies in nothing, though its adapter alone would fit."""
    hosts = Hosts({"run": 2, "idle": 3, "head": 3})
    sim = _sim(hosts, 96, REGION[mode], max_num_seqs=8, prefetch=0)
    _add(sim, hosts, "idle", "idle", prompt=4, output=1)
    sim.run()  # leaves "idle" resident, unpinned
    _add(sim, hosts, "r", "run", prompt=160, output=40)
    sim.step()
    before = ({r.host.name for r in sim.scheduler.adapters.resident()}, sim.scheduler.adapters.loads)
    head = _add(sim, hosts, "h", "head", prompt=240, output=1)  # 61 pages of KV: more than is free
    for _ in range(4):
        sim.step()
        assert head in sim.scheduler.waiting
        after = ({r.host.name for r in sim.scheduler.adapters.resident()}, sim.scheduler.adapters.loads)
        assert after == before
    sim.run()
    assert head in sim.finished


def test_prefetch_leaves_the_request_its_own_kv_in_the_unified_pool() -> None:
    """An adapter is copied ahead only where its request's KV still fits beside it: otherwise the running
    requests' growth would evict it before the request could run."""
    hosts = Hosts({"run": 1, "big": 10, "small": 10})
    sim = _sim(hosts, 100, None, max_num_seqs=1)
    _add(sim, hosts, "r", "run", prompt=4, output=200)  # runs alone (max_num_seqs 1), 2 pages
    sim.step()
    _add(sim, hosts, "b", "big", prompt=360, output=1)  # 90 pages of KV: with its adapter, more than is free
    _add(sim, hosts, "s", "small", prompt=8, output=1)
    sim.step()
    resident = {r.host.name for r in sim.scheduler.adapters.resident()}
    assert resident == {"run", "small"}


def test_prefetch_keeps_the_queue_heads_adapter_longest() -> None:
    """Adapters copied ahead are evicted from the back of the queue first: the head's is the most recently used."""
    hosts = Hosts({"run": 1, "a": 2, "b": 2, "c": 2})
    sim = _sim(hosts, 100, None, max_num_seqs=1)
    _add(sim, hosts, "r", "run", prompt=4, output=50)
    sim.step()
    for name in ("a", "b", "c"):
        _add(sim, hosts, name, name, prompt=4, output=1)
    sim.step()
    cache = sim.scheduler.adapters
    last_used = {r.host.name: r.last_used for r in cache.resident()}
    assert last_used["a"] > last_used["b"] > last_used["c"]
    cache.evict(sim.scheduler.pool.num_free + 2)  # the pages of one adapter more than are free
    assert {r.host.name for r in cache.resident()} == {"run", "a", "b"}
