"""The heavy tenants' cap under `fair` with `itl_slo_s` (slot_shares.py): a BatchLimiter that follows the pace of
every step, prompts included.

The cap of all running requests (batch_limit.py) leaves out the steps that compute prompts: one long prompt's step
says nothing about the batch, and a cut for it would only keep requests waiting. A flood is different. Its
admissions bring its prompts, so at a steady rate of arrivals the prompt tokens a second follow the batch it is let
into, and the steps that compute them are the ones a light tenant's tokens wait behind: on the GPU, decode steps
held the heavy target while the light tenants' tokens came much slower (perf/RESULTS.md, session 28). A running
request gets one token a step, of whatever kind, so its time per output token is the mean time between consecutive
steps' tokens. This limiter holds that mean at its target: it counts every step and judges the window by its mean
(a median would pass over steps with prompts that come less than every other step). It takes each step's interval
on the host (Step.wall_s), not its time on the device: a step's own device time is what the cap of all running
requests needs, but the mean of the intervals is the time that passed, and it also holds what the device does not
see, as an eager step's launches that the GPU waits for. The cap it keeps only bounds the heavy tenants' admissions
while other tenants have work, so a cut never keeps a light tenant's request waiting.
"""

from __future__ import annotations

import statistics

from slora.backend.engine.batch_limit import WINDOW, BatchLimiter
from slora.backend.engine.step_clock import Step


class PaceLimiter(BatchLimiter):
    STEPS = "steps (prompts included)"
    STATISTIC = "mean"

    @property
    def step_s(self) -> float | None:
        """The mean interval of the window's steps; None until it holds WINDOW of them."""
        return statistics.fmean(s.interval_s for s in self._window) if len(self._window) == WINDOW else None

    def observe(self, step: Step, held: bool) -> None:
        """As BatchLimiter.observe, with every step in the window."""
        if self._draining(step.seqs):
            return
        self._window.append(step)
        self._judge(step.seqs, held)
