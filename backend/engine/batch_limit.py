"""Inter-token-latency admission (`EngineConfig.itl_slo_s`): no more running requests than keep steps that short.

Every running request gets one token per step, so a step's duration is the time between two of its tokens. On a
saturated GPU each request added to the batch makes every step longer: with room in the pool and batch slots
free, continuous batching admits a burst (one tenant's flood, say) into the batch, and every tenant's tokens come
slower. With `itl_slo_s`, the running requests are capped instead, and the rest wait in the policy's order: under
`fair`, the light tenants' requests are admitted ahead of the flood's backlog (VTC), and early abort refuses what
would then miss its first-token SLO.

The cap moves by additive increase, multiplicative decrease on the steps' moving average (the time from one plan to
the next, idle time not counted):

    average > itl_slo_s        cap = the requests running × itl_slo_s / average (between FLOOR and DECREASE of
                               them, at least 1), then COOLDOWN_STEPS steps unchanged (the average takes that long
                               to show the smaller batch)
    average ≤ itl_slo_s and the cap binds (as many running as it allows)   cap + 1, up to max_num_seqs

Running requests are never preempted for it: the batch shrinks as they finish.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

DECREASE = 0.9  # the least cut: steps just over the target
FLOOR = 0.5  # the most: steps far over it (a step's time is not all per request)
COOLDOWN_STEPS = 8
ALPHA = 1 / 8  # weight of the newest step in the moving average


class BatchLimiter:
    def __init__(self, itl_slo_s: float, max_num_seqs: int) -> None:
        self.itl_slo_s = itl_slo_s
        self.max_num_seqs = max_num_seqs
        self.cap = max_num_seqs
        self.step_s: float | None = None  # the moving average
        self._last: float | None = None  # when the previous step was planned, while requests ran
        self._cooldown = 0
        self._warned = False

    def planned(self, now: float, running: int) -> None:
        """A step is being planned at `now`, with `running` requests in the batch before admission."""
        if self._last is not None:
            seconds = now - self._last
            self.step_s = seconds if self.step_s is None else self.step_s + ALPHA * (seconds - self.step_s)
            self._adjust(running)
        self._last = now if running else None

    def idle(self) -> None:
        """Nothing runs: the time until the next plan is no step."""
        self._last = None

    def _adjust(self, running: int) -> None:
        assert self.step_s is not None
        if self._cooldown:
            self._cooldown -= 1
        elif self.step_s > self.itl_slo_s:
            if self.cap == 1 and running <= 1 and not self._warned:
                logger.warning("itl_slo_s=%g s cannot be met: steps of one running request take %.3g s", self.itl_slo_s,
                               self.step_s)  # fmt: skip
                self._warned = True
            cut = min(DECREASE, max(FLOOR, self.itl_slo_s / self.step_s))
            self.cap = max(1, min(self.cap, int(running * cut)))
            self._cooldown = COOLDOWN_STEPS
        elif running >= self.cap:
            self.cap = min(self.max_num_seqs, self.cap + 1)
