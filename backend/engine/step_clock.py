"""Engine steps timed from one plan to the next: what the SLO guard's rates and the batch limiter measure.

The scheduler plans a step, the engine runs it, the scheduler plans the next: the time between two plans is one
step's duration, and on a busy engine the time between two tokens of every request in it. One clock serves both
readers (slo.RateMeter, batch_limit.BatchLimiter), so that they agree on what a step took. `stop` is called when
nothing is left to run: the wait for new work is no step's time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    seconds: float
    prompt_tokens: int  # prompt tokens it computed (prefills and prefill chunks); 0: a decode-only step
    seqs: int  # requests it ran


class StepClock:
    def __init__(self) -> None:
        self._open: tuple[float, int, int] | None = None  # the step planned last: (when, prompt tokens, requests)

    def lap(self, now: float) -> Step | None:
        """The step planned last, timed up to `now` (the next plan); None when none ran since the clock stopped."""
        if self._open is None:
            return None
        start, prompt_tokens, seqs = self._open
        self._open = None
        return Step(now - start, prompt_tokens, seqs)

    def started(self, now: float, prompt_tokens: int, seqs: int) -> None:
        """A step of `seqs` requests computing `prompt_tokens` prompt tokens was planned at `now` (none if 0)."""
        self._open = (now, prompt_tokens, seqs) if seqs else None

    def stop(self) -> None:
        self._open = None
