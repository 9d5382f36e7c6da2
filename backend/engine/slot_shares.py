"""Batch slots under the itl_slo_s cap, split among tenants by weighted max-min fairness (fair policy).

With a cap on running requests (batch_limit.py) and a flood waiting, VTC alone still makes a light tenant's new
request wait for a slot to free, behind the flood's next admission when their counters tie, and for as long as
the batch drains after the cap is cut. Shares instead give each tenant with work (requests running or waiting) a
part of the cap: its whole demand when that is below its weighted level, the level otherwise, the level set so
that the shares fill the cap (water-filling). A tenant at its share is passed over; one clearly under it (below
the share's whole part) is admitted even while the batch is at the cap, since the tenants over theirs free those
slots as their requests finish, and are not admitted meanwhile. So a flood loses the slots that a cut takes,
and a light tenant gets the slots its requests need at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping


def slot_shares(slots: int, demands: Mapping[str, int], weight: Callable[[str], float]) -> dict[str, float]:
    """Each tenant's share of `slots`: min(demand, λ·weight), λ such that the shares sum to `slots` (every demand
    when they fit)."""
    if sum(demands.values()) <= slots:
        return {tenant: float(d) for tenant, d in demands.items()}
    order = sorted(demands, key=lambda t: demands[t] / weight(t))
    remaining, weights = float(slots), sum(weight(t) for t in order)
    shares: dict[str, float] = {}
    for i, tenant in enumerate(order):
        level = remaining / weights
        if demands[tenant] > level * weight(tenant):
            shares.update((t, level * weight(t)) for t in order[i:])
            break
        shares[tenant] = float(demands[tenant])
        remaining -= demands[tenant]
        weights -= weight(tenant)
    return shares


def may_admit(share: float, running: int, batch_full: bool) -> bool:
    """Whether a tenant with `running` requests may have one more: never at its share; while the batch is at the
    cap (`batch_full`), only when below the share's whole part."""
    if running >= math.ceil(share):
        return False
    return running < math.floor(share) or not batch_full
