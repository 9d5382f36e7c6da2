"""Engine steps, each timed by its own work: what the SLO guard's rates and the batch limiter measure.

On CUDA a step's time is its time on the device's stream: from an event recorded ahead of its forward to the copy
of its sampled tokens (model_runner.py, inflight.py). Timers on the host cannot give it with overlapped steps
(EngineConfig.overlap_steps): the engine plans and launches step k+1 before it reads step k's tokens, so the time
from one plan to the next is the GPU's time for the step before, and the time between two steps' tokens carries
the next step's launch (an eager prefill's kernels launched one by one). With admission every other step, prefill
steps and decode-only ones alternate, and either host timer gives a decode-only step a prefill's time: the limiter
then cuts the batch for prompts, a cut that makes no step shorter. Elsewhere (CPU, where a step runs while it is
launched) a step's time is the time between its tokens and the previous step's; after a pause (nothing to run, or
a plan with nothing in it) it is timed from its own plan.

The scheduler tells the clock of each plan (`started`); the engine, when it has read a step's tokens
(`finished`, in plan order, which returns the step for the engine's totals, step_totals.py); the scheduler takes
the steps finished since its last plan (`completed`). One clock serves every reader (slo.RateMeter,
batch_limit.BatchLimiter, the totals), so that they agree on what a step took.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    seconds: float
    prompt_tokens: int  # prompt tokens it computed (prefills and prefill chunks); 0: a decode-only step
    seqs: int  # requests it ran
    # From the previous step's tokens (or its own plan, after a pause) to its own, on the host: with overlapped
    # steps not this step's own work, but over consecutive steps they add up to the time that passed, launches
    # the GPU waited for included, so their mean is a running request's time per output token. None: `seconds`.
    wall_s: float | None = None

    @property
    def interval_s(self) -> float:
        return self.seconds if self.wall_s is None else self.wall_s


class StepClock:
    def __init__(self) -> None:
        self._launched: deque[tuple[float, int, int]] = deque()  # planned, tokens not read: (when, prompt, seqs)
        self._last_tokens: float | None = None  # when the last step's tokens were read; None after a pause
        self._done: list[Step] = []

    def started(self, now: float, prompt_tokens: int, seqs: int) -> None:
        """A step of `seqs` requests computing `prompt_tokens` prompt tokens was planned at `now`; a plan with no
        request is a pause."""
        if seqs:
            self._launched.append((now, prompt_tokens, seqs))
        else:
            self._last_tokens = None

    def finished(self, now: float, device_s: float | None = None) -> Step | None:
        """The oldest launched step's tokens were read at `now`: that step (None if no step is open); `device_s`:
        its time on the device, where it was timed there."""
        if not self._launched:
            return None
        start, prompt_tokens, seqs = self._launched.popleft()
        since = start if self._last_tokens is None else self._last_tokens
        self._last_tokens = now
        wall = now - since
        step = Step(wall, prompt_tokens, seqs) if device_s is None else Step(device_s, prompt_tokens, seqs, wall)
        self._done.append(step)
        return step

    def completed(self) -> list[Step]:
        """The steps finished since the last call, oldest first."""
        done, self._done = self._done, []
        return done

    def stop(self) -> None:
        """Nothing is left to run: the wait for new work is no step's time, and steps still open are dropped."""
        self._launched.clear()
        self._last_tokens = None
