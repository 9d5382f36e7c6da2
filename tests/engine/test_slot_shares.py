"""Slot shares under the itl_slo_s cap (backend/engine/slot_shares.py): the water-filling split against a brute-force
reference, the averaged demands against their closed form, and, on the scheduler stepped without a model, that a
cap cut falls on the flood while light tenants are admitted at once, that a light tenant's peak above the level of
the moment is admitted when its average fits, and that many tenants of one request each never take the batch past
the cap."""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter
from collections.abc import Mapping

import pytest

from slora.backend.engine.batch_limit import BatchLimiter
from slora.backend.engine.scheduling_policy import FairPolicy
from slora.backend.engine.slot_shares import (
    FLOOD_FACTOR,
    HEAVY_TARGET,
    DemandMeter,
    flooding,
    heavy,
    may_admit,
    shares,
    water_level,
)
from slora.backend.engine.tenants import TenantBook
from tests.engine.scheduler_sim import Sim, make_request, make_sim


def _reference(slots: int, demands: Mapping[str, float], weights: dict[str, float]) -> dict[str, float]:
    """Water-filling by bisection on the level λ: Σ min(d, λ·w) = slots."""
    lo, hi = 0.0, max(d / weights[t] for t, d in demands.items())
    for _ in range(200):
        mid = (lo + hi) / 2
        if sum(min(d, mid * weights[t]) for t, d in demands.items()) < slots:
            lo = mid
        else:
            hi = mid
    return {t: min(d, hi * weights[t]) for t, d in demands.items()}


@pytest.mark.parametrize("seed", range(20))
def test_the_water_level_gives_the_weighted_max_min_split(seed: int) -> None:
    rng = random.Random(seed)
    tenants = [f"t{i}" for i in range(rng.randint(1, 30))]
    demands = {t: rng.randint(1, 200) for t in tenants}
    weights = {t: rng.choice([0.5, 1.0, 2.0, 3.0]) for t in tenants}
    slots = rng.randint(1, 1000)
    level = water_level(slots, demands, weights.__getitem__)
    if sum(demands.values()) <= slots:
        assert level is None
        return
    assert level is not None
    split = {t: min(d, level * weights[t]) for t, d in demands.items()}
    assert sum(split.values()) == pytest.approx(slots)
    assert split == pytest.approx(_reference(slots, demands, weights), rel=1e-6)


def test_a_tenant_at_its_share_waits_and_one_clearly_under_it_passes_a_full_batch() -> None:
    assert not may_admit(7.6, 8, batch_full=False)
    assert may_admit(7.6, 7, batch_full=False) and not may_admit(7.6, 7, batch_full=True)
    assert may_admit(7.6, 6, batch_full=True)
    assert not may_admit(0.3, 0, batch_full=True) and may_admit(0.3, 0, batch_full=False)


def test_a_cut_falls_on_the_flood_and_light_requests_are_admitted_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    limiter = BatchLimiter(0.02, max_num_seqs=128)
    monkeypatch.setattr(limiter, "observe", lambda *args: None)  # the cap moves only as the test sets it
    limiter.cap = 64
    sim = make_sim("fair", pages=8000, max_num_seqs=128, limiter=limiter)
    rng = random.Random(3)
    for i in range(300):
        sim.add(make_request(f"flood-{i}", "flood", 4, rng.randint(20, 80)))
    sim.step()
    assert len(sim.scheduler.running) == 64
    limiter.cap = 40  # as a cut leaves it: the batch drains to 40 as the flood's requests finish
    lights = [make_request(f"light-{k}", f"light-{k % 3}", 4, 200, arrival=sim.clock.now) for k in range(6)]
    for request in lights:
        sim.add(request)
    sim.step()
    assert all(r in sim.scheduler.running for r in lights), "admitted past the cap at once"
    assert len(sim.scheduler.running) == 70
    flood = [sum(r.tenant == "flood" for r in sim.scheduler.running)]
    while flood[-1] > 40 - 6:
        sim.step()
        flood.append(sum(r.tenant == "flood" for r in sim.scheduler.running))
        assert sim.steps < 500
    assert all(a >= b for a, b in zip(flood, flood[1:])), "the flood was readmitted while over its share"
    for _ in range(50):  # the lights still run: the flood keeps to its share, the batch to the cap
        sim.step()
        assert len(sim.scheduler.running) <= 40 and sum(r.tenant == "flood" for r in sim.scheduler.running) <= 34
    assert all(r in sim.scheduler.running for r in lights)


def test_many_tenants_of_one_request_each_stay_within_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    limiter = BatchLimiter(0.02, max_num_seqs=64)
    monkeypatch.setattr(limiter, "observe", lambda *args: None)
    limiter.cap = 16
    sim = make_sim("fair", pages=4000, max_num_seqs=64, limiter=limiter)
    for i in range(300):
        sim.add(make_request(f"r{i}", f"tenant-{i}", 4, 8))
    while sim.scheduler.has_work():
        sim.step()
        assert len(sim.scheduler.running) <= 16
        sim.scheduler.pool.check_integrity()
    assert len(sim.finished) == 300


def test_a_held_tenant_is_passed_over_until_put_back_and_keeps_its_place() -> None:
    book = TenantBook()
    policy = FairPolicy(book, 1.0, 2.0)
    flood = [make_request(f"f{i}", "flood", 4, 4, arrival=float(i)) for i in range(5)]
    light = make_request("l0", "light", 4, 4, arrival=10.0)
    for request in [*flood, light]:
        policy.push(request)
    assert policy.peek() is flood[0]  # counters tie: the earlier head first
    policy.hold("flood")
    assert policy.peek() is light
    policy.take(light)
    assert policy.peek() is None and len(policy) == 5, "held, not gone"
    policy.put_back([])
    assert policy.peek() is flood[0] and list(policy) == flood


def test_averaged_demands_start_at_the_demand_and_decay_in_time() -> None:
    meter = DemandMeter(tau_s=2.0)
    assert meter.observe(10.0, {"a": 6, "b": 1}) == {"a": 6.0, "b": 1.0}  # first met: its demand, not 0
    averages = meter.observe(11.0, {"a": 2})
    keep = math.exp(-1.0 / 2.0)
    assert averages["a"] == pytest.approx(2 + 4 * keep) and averages["b"] == pytest.approx(keep)
    averages = meter.observe(31.0, {"a": 2})  # b, without work for 20 s, falls under FORGET_BELOW
    assert set(averages) == {"a"} and averages["a"] == pytest.approx(2 + 4 * keep * math.exp(-10.0))
    assert meter.observe(31.0, {"a": 9})["a"] == pytest.approx(averages["a"]), "no time passed: no change"


@pytest.mark.parametrize("seed", range(10))
def test_the_share_level_is_the_higher_water_level_of_the_moment_and_of_the_averages(seed: int) -> None:
    rng = random.Random(seed)
    tenants = [f"t{i}" for i in range(rng.randint(2, 20))]
    weights = {t: rng.choice([0.5, 1.0, 2.0]) for t in tenants}
    demands = {t: rng.randint(1, 60) for t in tenants}
    averages = {t: rng.uniform(0.5, 60.0) for t in tenants}
    slots = rng.randint(1, sum(demands.values()) - 1)
    averaged = _level(_reference(slots, averages, weights), weights) if sum(averages.values()) > slots else 0.0
    level = max(_level(_reference(slots, demands, weights), weights), averaged)
    assert shares(slots, demands, averages, weights.__getitem__) == pytest.approx(
        {t: level * weights[t] for t in tenants}, rel=1e-6
    )
    fitting = shares(sum(demands.values()), demands, averages, weights.__getitem__)
    assert fitting == {t: float(d) for t, d in demands.items()}, "demands that fit: each its own"


def test_averages_over_the_slots_by_a_rounding_error_still_give_a_level() -> None:
    averages = {"a": 0.2, "b": 0.1, "c": 0.15, "d": 0.45, "e": 0.1}  # sums to 1.0000000000000002
    assert sum(averages.values()) > 1
    assert water_level(1, averages, lambda t: 1.0) == pytest.approx(0.45)


def _level(split: dict[str, float], weights: dict[str, float]) -> float:
    return max(split[t] / weights[t] for t in split)


def test_a_light_tenants_peak_is_admitted_at_the_cap_when_its_average_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 light tenants hold 4 requests each for long, a flood the rest of a cap of 41: averaged, the flood's level
    is 9. When one light tenant's load doubles, the level of the moment (6.5) would hold it at 6; it gets all 8."""
    limiter = BatchLimiter(0.02, max_num_seqs=128)
    monkeypatch.setattr(limiter, "observe", lambda *args: None)
    limiter.cap = 41
    sim = make_sim("fair", pages=20000, max_num_seqs=128, limiter=limiter)
    for k in range(8):
        for i in range(4):
            sim.add(make_request(f"light-{k}-{i}", f"light-{k}", 4, 5000, arrival=sim.clock.now))
    for i in range(200):
        sim.add(make_request(f"flood-{i}", "flood", 4, 5000, arrival=sim.clock.now))
    for _ in range(1000):  # 10 s: five times the averages' time constant
        sim.step()
    running = Counter(r.tenant for r in sim.scheduler.running)
    assert running == {**{f"light-{k}": 4 for k in range(8)}, "flood": 9}
    peak = [make_request(f"peak-{i}", "light-0", 4, 5000, arrival=sim.clock.now) for i in range(4)]
    for request in peak:
        sim.add(request)
    demands = running + Counter(sim.scheduler.policy.waiting_by_tenant())
    assert water_level(41, demands, lambda t: 1.0) == pytest.approx(6.5)  # what the moment alone would allow
    sim.step()
    assert all(r in sim.scheduler.running for r in peak), "the peak admitted past the cap at once"
    assert Counter(r.tenant for r in sim.scheduler.running)["flood"] == 9, "the flood is not admitted meanwhile"


def test_heavy_tenants_are_those_whose_averaged_demand_is_over_their_share() -> None:
    split = {"flood": 12.0, "a": 12.0, "b": 12.0}
    assert heavy(split, {"flood": 300.0, "a": 20.0, "b": 5.0}) == {"flood", "a"}
    assert heavy(split, {"flood": 12.0}) == frozenset(), "at its share is not over it"


def _paced_sim(cap: int, target: float = 0.018) -> Sim:
    limiter = BatchLimiter(target, max_num_seqs=256)
    limiter.cap = cap
    sim = make_sim("fair", pages=40_000, max_num_seqs=256, limiter=limiter, admit_interval=2)
    sim.pace = lambda batch: 0.006 + 0.00007 * batch  # the H200-like step of perf/sim_noisy.py
    return sim


def test_a_flood_is_admitted_only_while_steps_stay_under_the_heavy_target() -> None:
    """With light tenants at work, the flood fills the batch only up to where steps take HEAVY_TARGET of
    itl_slo_s; the light tenants' requests go up to the full target."""
    sim = _paced_sim(256)
    for i in range(1000):
        sim.add(make_request(f"flood-{i}", "flood", 8, 400, arrival=sim.clock.now))
    for k in range(10):
        for i in range(3):
            sim.add(make_request(f"light-{k}-{i}", f"light-{k}", 8, 2000, arrival=sim.clock.now))
    for _ in range(1500):
        sim.step()
    heavy_cap = sim.scheduler.heavy_limiter.cap
    heavy_batch = (HEAVY_TARGET * 0.018 - 0.006) / 0.00007  # where steps take HEAVY_TARGET of the target: 133
    assert 0.8 * heavy_batch <= heavy_cap <= 1.1 * heavy_batch, heavy_cap
    batches = [len(p.seqs) for p in sim.plans[-300:]]
    assert max(batches) <= heavy_cap + 30 + 2, "the flood stays under the heavy cap, the lights' 30 above it"
    assert statistics.median(sim.durations[-300:]) < 0.018


def test_a_cap_cut_low_grows_back_while_backlogged_tenants_count_as_heavy() -> None:
    """How a reserve kept from the heavy tenants failed on the GPU (perf/RESULTS.md, session 25): after a warm-up
    cut, tenants backlogged behind it count as heavy, and a bound below the cap kept the batch where the cap never
    grows."""
    sim = _paced_sim(26)
    sim.scheduler.heavy_limiter.cap = 26
    for k in range(20):
        for i in range(40 if k < 10 else 2):
            sim.add(make_request(f"t{k}-{i}", f"t{k}", 8, 300, arrival=sim.clock.now))
    for _ in range(400):
        sim.step()
    assert sim.scheduler.limiter.cap > 120 and max(len(p.seqs) for p in sim.plans[-50:]) > 120  # not 26


def test_a_flood_is_a_demand_far_over_the_median_tenants() -> None:
    def weight(tenant: str) -> float:
        return 1.0

    lights = {f"t{k}": 4 + k % 3 for k in range(20)}  # 4-6 each: the median tenant has 5
    assert flooding(lights, weight) == frozenset(), "tenants of equal rates are never a flood for their peaks"
    assert flooding({**lights, "peak": 25}, weight) == frozenset(), "5 x the median is not over it"
    assert flooding({**lights, "flood": 26}, weight) == {"flood"}
    assert flooding({"flood": 500}, weight) == frozenset(), "one tenant alone is never held back"
    assert flooding({"light": 1, "flood": 30}, weight) == {"flood"}, "of two, the lower one is the median"
    assert flooding({"a": 0, "b": 0, "c": int(FLOOD_FACTOR) + 1}, weight) == {"c"}, "over FLOOD_FACTOR requests"
    assert flooding({"a": 0, "b": 0, "c": int(FLOOD_FACTOR)}, weight) == frozenset()
    weights = {"big": 10.0}
    assert flooding({**lights, "big": 200}, lambda t: weights.get(t, 1.0)) == frozenset(), "demand per weight"


def test_a_flood_that_starts_while_the_cap_has_room_is_held_at_the_heavy_cap() -> None:
    """Every request with work fits the cap of all running requests (256), but not the heavy tenants' (40): the
    flood is admitted only up to the heavy cap, and light tenants' new requests still go in at once. Before the
    flood's average rises over its share, nothing else holds it (slot_shares.py)."""
    sim = _paced_sim(256)
    sim.scheduler.heavy_limiter.cap = 40
    for k in range(10):
        for i in range(3):
            sim.add(make_request(f"light-{k}-{i}", f"light-{k}", 8, 2000, arrival=sim.clock.now))
    sim.step()
    for i in range(200):
        sim.add(make_request(f"flood-{i}", "flood", 8, 2000, arrival=sim.clock.now))
    for _ in range(4):
        sim.step()
    running = Counter(r.tenant for r in sim.scheduler.running)
    assert running["flood"] == 40 - 30, running
    for k in range(10):
        sim.add(make_request(f"light-{k}-late", f"light-{k}", 8, 2000, arrival=sim.clock.now))
    sim.step()
    sim.step()  # admission every other step
    running = Counter(r.tenant for r in sim.scheduler.running)
    assert sum(v for t, v in running.items() if t != "flood") == 40, "the light tenants' new requests went in"
    assert running["flood"] == 10
