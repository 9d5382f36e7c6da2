"""Slot shares under the itl_slo_s cap (backend/engine/slot_shares.py): the water-filling split against a brute-force
reference, and, on the scheduler stepped without a model, that a cap cut falls on the flood while light tenants
are admitted at once, and that many tenants of one request each never take the batch past the cap."""

from __future__ import annotations

import random

import pytest

from slora.backend.engine.batch_limit import BatchLimiter
from slora.backend.engine.scheduling_policy import FairPolicy
from slora.backend.engine.slot_shares import may_admit, slot_shares
from slora.backend.engine.tenants import TenantBook
from tests.engine.scheduler_sim import make_request, make_sim


def _reference(slots: int, demands: dict[str, int], weights: dict[str, float]) -> dict[str, float]:
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
def test_shares_are_the_weighted_max_min_split(seed: int) -> None:
    rng = random.Random(seed)
    tenants = [f"t{i}" for i in range(rng.randint(1, 30))]
    demands = {t: rng.randint(1, 200) for t in tenants}
    weights = {t: rng.choice([0.5, 1.0, 2.0, 3.0]) for t in tenants}
    slots = rng.randint(1, 1000)
    shares = slot_shares(slots, demands, weights.__getitem__)
    if sum(demands.values()) <= slots:
        assert shares == {t: float(d) for t, d in demands.items()}
        return
    assert sum(shares.values()) == pytest.approx(slots)
    assert shares == pytest.approx(_reference(slots, demands, weights), rel=1e-6)
    assert all(0 < shares[t] <= demands[t] + 1e-9 for t in tenants)


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
