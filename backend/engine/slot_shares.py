"""Batch slots under the itl_slo_s cap, split among tenants by weighted max-min fairness (fair policy).

With a cap on running requests (batch_limit.py) and a flood waiting, VTC alone still makes a light tenant's new
request wait for a slot to free, behind the flood's next admission when their counters tie, and for as long as
the batch drains after the cap is cut. Shares instead give each tenant with work (requests running or waiting) a
part of the cap. A tenant at its share is passed over; one clearly under it (below the share's whole part) is
admitted even while the batch is at the cap (up to max_num_seqs), since the tenants over theirs free those slots
as their requests finish, and are not admitted meanwhile. So a flood loses the slots that a cut takes, and a light
tenant gets the slots its requests need at once.

A tenant's share is the water level of max-min fairness times its weight: the level λ at which Σ min(demand,
λ·weight) = cap, over the demands (requests running and waiting) of the moment, or over each tenant's demand
averaged over the last DEMAND_TAU_S or so (DemandMeter), whichever level is higher. A light tenant's requests
come at random times, so the number it has running swings around its mean; over the demands of the moment its
peaks sum with every other light tenant's into a level that holds each one at its peak, even while a flood takes
the rest of the cap. Over the averages its peaks are gone, and the level leaves it room for them. The level of
the moment is there for what averages are slow to see: a flood that comes from nowhere is over its share at
once, and while averages still fit under the cap (a flood's backlog building), the tenants of the moment are
split as they stand. The share is the level, not the demand under it: a tenant under the level runs all it
asks for, and its next request, should it come, is admitted at once.

A heavy tenant, one whose averaged demand is over its share (a flood, not a light tenant's peak), is admitted,
while any other tenant has work, only up to a second cap: the batch at which steps take HEAVY_TARGET of
itl_slo_s on average, prompts included, kept by a PaceLimiter of its own (pace_limit.py, Scheduler.heavy_limiter).
Left to fill the cap, a flood keeps every step at the target: the light tenants' requests then live longer, more
of them run at once, and at a high load they alone come near the cap, where their random peaks wait for slots.
Under the second cap the steps stay shorter, and the slots above it are there for those peaks. It is a cap on
step time, not a part of the first cap, so that a bound below the first cap cannot keep the batch where neither
grows: each grows while the batch is at it and steps are under its target.

A flood that starts while the first cap has room (every request with work fits under it, as after a quiet spell)
would be let in whole before its average rose over its share: on the scheduler stepped without a model, that start
made the light tenants' steps slow for the seconds the flood took to drain (perf/RESULTS.md, session 30). So a
tenant is also heavy at once when its demand of the moment, per weight, is over FLOOD_FACTOR times the median
tenant's (`flooding`), and the second cap bounds it whenever more requests have work than that cap allows, under
the first cap or over it. The median is of the tenants with work, so tenants of equal rates never count as a
flood for their random peaks, and one tenant alone is never held back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

DEMAND_TAU_S = 5.0  # the averages' time constant: about a light request's life, so that its peaks even out
FORGET_BELOW = 0.01  # a tenant without work whose average decayed below this leaves the averages


class DemandMeter:
    """Each tenant's demand (requests running and waiting), as an exponential average in time."""

    def __init__(self, tau_s: float = DEMAND_TAU_S) -> None:
        self.tau_s = tau_s
        self.average: dict[str, float] = {}
        self._last: float | None = None

    def observe(self, now: float, demands: Mapping[str, int]) -> dict[str, float]:
        """The averages after the demands of `now` (tenants not in `demands` have none)."""
        keep = 1.0 if self._last is None else math.exp(-max(now - self._last, 0.0) / self.tau_s)
        self._last = now
        average = self.average
        for tenant in [t for t in average if t not in demands]:
            value = average[tenant] * keep
            if value < FORGET_BELOW:
                del average[tenant]
            else:
                average[tenant] = value
        for tenant, demand in demands.items():
            previous = average.get(tenant)
            average[tenant] = float(demand) if previous is None else demand + (previous - demand) * keep
        return average


def water_level(slots: int, demands: Mapping[str, float], weight: Callable[[str], float]) -> float | None:
    """λ such that Σ min(demand, λ·weight) = slots; None when the demands fit."""
    if sum(demands.values()) <= slots:
        return None
    order = sorted(demands, key=lambda t: demands[t] / weight(t))
    remaining, weights = float(slots), sum(weight(t) for t in order)
    level = 0.0
    for tenant in order:
        level = remaining / weights
        if demands[tenant] > level * weight(tenant):
            return level
        remaining -= demands[tenant]
        weights -= weight(tenant)
    return level  # averages over the slots by a rounding error only: the last tenant's level


def shares(
    slots: int, demands: Mapping[str, int], averages: Mapping[str, float], weight: Callable[[str], float]
) -> dict[str, float]:
    """Each tenant's share of `slots` (module docstring): level·weight, the level the higher of the water levels of
    the demands of the moment and of the averaged ones; every demand when the demands fit."""
    now = water_level(slots, demands, weight)
    if now is None:
        return {tenant: float(d) for tenant, d in demands.items()}
    level = max(now, water_level(slots, averages, weight) or 0.0)
    return {tenant: level * weight(tenant) for tenant in demands}


HEAVY_TARGET = 0.85  # of itl_slo_s: the mean step time up to which heavy tenants are admitted while others have work


def heavy(shares: Mapping[str, float], averages: Mapping[str, float]) -> frozenset[str]:
    """The tenants whose averaged demand is over their share."""
    return frozenset(t for t, share in shares.items() if averages.get(t, 0.0) > share)


FLOOD_FACTOR = 5.0  # times the median tenant's demand of the moment (per weight): a flood, seen as it starts


def flooding(demands: Mapping[str, int], weight: Callable[[str], float]) -> frozenset[str]:
    """The tenants whose demand per weight is over FLOOD_FACTOR times the (lower) median tenant's, and over
    FLOOD_FACTOR requests; none while fewer than two tenants have work."""
    if len(demands) < 2:
        return frozenset()
    per = sorted(d / weight(t) for t, d in demands.items())
    bar = FLOOD_FACTOR * max(per[(len(per) - 1) // 2], 1.0)
    return frozenset(t for t, d in demands.items() if d / weight(t) > bar)


def may_admit(share: float, running: int, batch_full: bool) -> bool:
    """Whether a tenant with `running` requests may have one more: never at its share; while the batch is at the
    cap (`batch_full`), only when below the share's whole part."""
    if running >= math.ceil(share):
        return False
    return running < math.floor(share) or not batch_full
