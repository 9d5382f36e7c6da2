"""Inter-token-latency admission (`EngineConfig.itl_slo_s`): no more running requests than keep decode steps that
short.

Every running request gets one token per step, so a step's duration is the time between two of its tokens. On a
saturated GPU each request added to the batch makes every step longer: with room in the pool and batch slots
free, continuous batching admits a burst (one tenant's flood, say) into the batch, and every tenant's tokens come
slower. With `itl_slo_s`, the running requests are capped instead, and the rest wait in the policy's order: under
`fair`, the light tenants' requests are admitted ahead of the flood's backlog (VTC), and early abort refuses what
would then miss its first-token SLO.

The cap follows the median of the last WINDOW decode-only steps, each timed by its own work (step_clock.py: on CUDA,
its time on the device's stream). Steps that computed prompt tokens are left out: how long a prefill takes depends
on its prompts, not on the batch, and a cap cut for a long prompt would only keep requests waiting (unless WINDOW
steps in a row computed prompts, as while a long prompt is prefilled in chunks or admission runs every step: then
each counts until a decode-only step comes, so that the batch cannot grow unseen). The median ignores the odd slow
step (a compile, a collection), and no verdict comes before WINDOW steps were seen, so a fresh engine's first steps
move nothing.

    median > itl_slo_s    a verdict on the window, which then starts again: cap = the step's batch × itl_slo_s /
                          median, between FLOOR and DECREASE of it (at least 1), if that is below the cap (a
                          batch above the cap cuts it only when a cut of its own would go below it)
    median ≤ itl_slo_s and the cap holds requests back    cap + 1, up to max_num_seqs;
                          cap + max(FAST_LEAST, cap / FAST_GROWTH) while the median is under GROW_FAST_BELOW of
                          the target, up to the window's batch × itl_slo_s / median (after a cut that the load
                          no longer needs, a slow start or a burst of long steps, the cap is back within a few
                          windows, not a step per request)

After a cut, the steps of a batch still draining down to it are left out: they would only cut again for what the
last cut already took (the next verdict is on WINDOW steps of the smaller batch). Other steps of a batch above the
cap count: under `fair`, slot shares let light tenants past the cap, and a batch that stays above it for WINDOW
steps without shrinking is no longer draining. A limiter that waited for such a batch to come down to the cap
would neither grow nor cut, and a cap cut by a start-up burst would stay where the burst left it, holding every
tenant at a share of too few slots. The cap holds requests back when, at a plan, as many run as it allows (or
more) and requests wait.

A cut is small, since a step's time is not all per request and the batch only shrinks as requests finish: while it
drains to the cap nobody is admitted (under `fcfs` and `priority`). Running requests are never preempted for it.
Under `fair` the cap's slots are split among the tenants by weighted max-min fairness (slot_shares.py): a cut
then falls on the tenants above their share, and a light tenant's requests are admitted at once, even while the
batch drains. A batch of one is never cut (nothing to gain): steps of one request over the target are logged once.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque

from slora.backend.engine.step_clock import Step

logger = logging.getLogger(__name__)

WINDOW = 16  # decode steps per verdict
DECREASE = 0.95  # the least cut: steps just over the target
FLOOR = 0.8  # the most: steps far over it
GROW_FAST_BELOW = 0.8  # steps this far under the target: the cap grows by 1/FAST_GROWTH of itself a step
FAST_GROWTH = 32
FAST_LEAST = 4  # far under the target, at least this many a step: a cap cut to a few slots is back within a window


class BatchLimiter:
    STEPS = "decode steps"  # what the window holds, in the log lines
    STATISTIC = "median"

    def __init__(self, itl_slo_s: float, max_num_seqs: int, name: str = "running requests") -> None:
        """`name`: what the cap is of, in its log lines."""
        self.itl_slo_s = itl_slo_s
        self.name = name
        self.max_num_seqs = max_num_seqs
        self.cap = max_num_seqs
        self._window: deque[Step] = deque(maxlen=WINDOW)
        self._warned = False
        self._prefill_run = 0  # steps in a row that computed prompt tokens
        self._drain: tuple[int, int] | None = None  # after a cut: (the least batch since, steps without a lesser)

    @property
    def step_s(self) -> float | None:
        """The median of the window's decode steps; None until it holds WINDOW of them."""
        return statistics.median(s.seconds for s in self._window) if len(self._window) == WINDOW else None

    def observe(self, step: Step, held: bool) -> None:
        """At a plan: `step` is one whose tokens came since the last plan; `held`: whether the cap holds requests
        back (as many run as it allows, or more, and requests wait)."""
        if self._draining(step.seqs):
            return
        self._prefill_run = self._prefill_run + 1 if step.prompt_tokens else 0
        if 0 < self._prefill_run < WINDOW:
            return
        self._window.append(step)
        self._judge(step.seqs, held)

    def _judge(self, batch: int, held: bool) -> None:
        """A verdict on the window (step_s) after a step of `batch` requests, once the window is full."""
        seconds = self.step_s
        if seconds is None:
            return
        if seconds > self.itl_slo_s:
            self._cut(batch, seconds)
        elif held:
            self.cap = min(self.max_num_seqs, self._grown(seconds))

    def _draining(self, batch: int) -> bool:
        """Whether a step of `batch` requests is one of the batch draining down to a cut: above the cap and still
        shrinking (a new least batch within the last WINDOW steps)."""
        if self._drain is None:
            return False
        least, flat = self._drain
        if batch <= self.cap or flat >= WINDOW:
            self._drain = None
            return False
        self._drain = (batch, 0) if batch < least else (least, flat + 1)
        return True

    def _grown(self, median: float) -> int:
        """The cap after a step under the target that held requests back: one more, or, far under the target, a
        fraction of itself more, but no further than the window's batch scaled by target / median (what steps
        with a fixed part take no longer than, per request; the window lags the growth by half its length)."""
        if median >= GROW_FAST_BELOW * self.itl_slo_s:
            return self.cap + 1
        seen = statistics.median_low(s.seqs for s in self._window) * self.itl_slo_s / median
        return max(self.cap + 1, min(self.cap + max(FAST_LEAST, self.cap // FAST_GROWTH), int(seen)))

    def _cut(self, batch: int, median: float) -> None:
        if batch <= 1:
            if not self._warned:
                logger.warning("itl_slo_s=%g s cannot be met: %s of one request take %.3g s",
                               self.itl_slo_s, self.STEPS, median)  # fmt: skip
                self._warned = True
            return
        cut = min(DECREASE, max(FLOOR, self.itl_slo_s / median))
        cap = max(1, int(batch * cut))
        self._window.clear()  # one verdict per window of steps
        if cap >= self.cap:
            return  # a batch above the cap, no slower than its own cut allows
        logger.info("target %g s: %s of %d requests take %.3g s (%s): %s capped at %d (was %d)",
                    self.itl_slo_s, self.STEPS, batch, median, self.STATISTIC, self.name, cap, self.cap)  # fmt: skip
        self.cap = cap
        self._drain = (batch, 0)
