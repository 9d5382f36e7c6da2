"""SLO-aware admission: refuse a waiting request as soon as its first token can no longer come in time.

S-LoRA's early abort, with the wait estimated from what the engine measured instead of a fixed margin:

    deadline  = arrival + ttft_slo_s (the request's own, else EngineConfig.ttft_slo_s)
    expected  = now + (ahead + 1) / admitted_per_s + own prefill       (ahead: the policy's `positions`)
    refused when now ≥ deadline ("ttft_slo"), when expected > deadline ("ttft_slo_early", with early_abort),
    or when it waited queue_timeout_s without being admitted ("queue_timeout")

`admitted_per_s` counts the admissions of the last RATE_WINDOW_S seconds' admission rounds that left requests
waiting (then free slots, not arrivals, set the pace: RateMeter); the own prefill is its prompt at the recent
seconds per prompt token of steps with prompts, at least one step. Until such rounds covered MIN_BUSY_S there is
no estimate and only passed deadlines refuse; so it is at a request's admission, where the estimate would be of its
own prefill alone. An estimate errs on the side of admitting: a request refused early is a certain miss.
A refused request gets a final output with finish_reason "rejected" and a SloRefusedError naming the field; only
requests with no token yet are refused (a preempted one that had streamed tokens is not).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from slora.backend.engine.request import Request
from slora.backend.engine.step_clock import Step
from slora.backend.errors import InvalidRequestError, SloRefusedError

RATE_WINDOW_S = 5.0
MIN_BUSY_S = 0.5
MIN_PREFILL_STEPS = 8
SWEEP_INTERVAL_S = 0.02  # the whole queue is checked at most this often; the head at every admission
_ALPHA = 1 / 16  # weight of the newest step in the per-step averages


class RefusalReason(str, enum.Enum):
    TTFT_SLO = "ttft_slo"
    TTFT_SLO_EARLY = "ttft_slo_early"
    QUEUE_TIMEOUT = "queue_timeout"


@dataclass(frozen=True)
class SloSettings:
    """The server-wide part (EngineConfig.ttft_slo_s, queue_timeout_s, early_abort)."""

    ttft_slo_s: float | None = None
    queue_timeout_s: float | None = None
    early_abort: bool = True


def check_ttft_slo(ttft_slo_s: object) -> float | None:
    """A request's `ttft_slo_s` (None: the server's); raises InvalidRequestError naming the field."""
    if ttft_slo_s is None:
        return None
    # `not 0 < x < inf` also refuses NaN
    if isinstance(ttft_slo_s, bool) or not isinstance(ttft_slo_s, (int, float)) or not 0 < ttft_slo_s < float("inf"):
        raise InvalidRequestError(f"ttft_slo_s must be a finite number of seconds > 0, got {ttft_slo_s!r}")
    return float(ttft_slo_s)


def set_deadlines(request: Request, settings: SloSettings, ttft_slo_s: float | None) -> None:
    """Give `request` its deadlines from its arrival: its own ttft_slo_s, else the server's; the queue timeout."""
    slo = ttft_slo_s if ttft_slo_s is not None else settings.ttft_slo_s
    request.ttft_slo_s = slo
    request.ttft_deadline = request.arrival_time + slo if slo is not None else None
    timeout = settings.queue_timeout_s
    request.queue_deadline = request.arrival_time + timeout if timeout is not None else None


class RateMeter:
    """Recent admissions per second while admission was the bottleneck, seconds per step and per prompt token.

    `observe` takes each timed step (step_clock.py), `planned` is called at every step's plan. An admission round
    that left requests waiting (the batch, the budget or the pool was full) admitted what the time since the round
    before freed: those rounds alone give the rate (a round that admitted everyone says only how fast requests
    arrived, and a step without a round, with admit_interval > 1, that it was not due). `idle` stops the round
    clock when nothing is left to run, so that time without work counts as no round's.
    """

    def __init__(self, window_s: float = RATE_WINDOW_S, min_busy_s: float = MIN_BUSY_S) -> None:
        self.window_s = window_s
        self.min_busy_s = min_busy_s
        self.step_s = 0.0
        self._prompt_tokens = 0.0  # averages over steps with prompts: tokens, seconds
        self._prompt_s = 0.0
        self._prompt_steps = 0
        self._rounds: deque[tuple[float, float, int]] = deque()  # limited rounds: (time, seconds since the last, n)
        self._rounds_s = 0.0
        self._rounds_admitted = 0
        self._last_round: float | None = None  # when the last admission round ran

    def observe(self, step: Step) -> None:
        self.step_s = step.seconds if self.step_s == 0.0 else self.step_s + _ALPHA * (step.seconds - self.step_s)
        if step.prompt_tokens:
            self._prompt_steps += 1
            self._prompt_tokens += _ALPHA * (step.prompt_tokens - self._prompt_tokens)
            self._prompt_s += _ALPHA * (step.seconds - self._prompt_s)

    def planned(self, now: float, admitted: int, admission: bool, waiting: bool) -> None:
        """A plan at `now`; `admission`: it ran an admission round, which admitted `admitted` and left requests
        `waiting` or not."""
        if not admission:
            return
        if waiting and self._last_round is not None:
            self._rounds.append((now, now - self._last_round, admitted))
            self._rounds_s += now - self._last_round
            self._rounds_admitted += admitted
        self._last_round = now
        while self._rounds and self._rounds[0][0] < now - self.window_s:
            _, old_s, old_admitted = self._rounds.popleft()
            self._rounds_s -= old_s
            self._rounds_admitted -= old_admitted

    def idle(self) -> None:
        self._last_round = None

    def admitted_per_s(self) -> float | None:
        """None until limited rounds covering min_busy_s were seen in the window, or while they admitted none
        (long requests can hold every slot for a while: no evidence that none will ever free)."""
        if self._rounds_s < self.min_busy_s or self._rounds_admitted <= 0:
            return None
        return self._rounds_admitted / self._rounds_s

    def prefill_s(self, prompt_tokens: int) -> float:
        """Seconds to compute a prompt of this length, at least one step (only one step until MIN_PREFILL_STEPS
        steps with prompts were seen: the first steps of an engine can be slow once, for compiling and caching)."""
        if self._prompt_steps < MIN_PREFILL_STEPS:
            return self.step_s
        return max(self.step_s, prompt_tokens * self._prompt_s / self._prompt_tokens)


class SloGuard:
    """Decides which waiting requests to refuse; the scheduler removes them and frees what they hold."""

    def __init__(self, settings: SloSettings, meter: RateMeter | None = None) -> None:
        self.settings = settings
        self.meter = meter or RateMeter()
        self.next_sweep = 0.0

    def check(self, request: Request, now: float, ahead: float | None) -> SloRefusedError | None:
        """A refusal for `request` waiting at `now` with `ahead` admissions before its own (None: it is next,
        to be admitted now), or None to keep it waiting."""
        if request.num_output or request.num_inflight:
            return None  # it has had a token: its first-token SLO is behind it
        if request.queue_deadline is not None and now >= request.queue_deadline and not request.num_preemptions:
            return _refusal(request, RefusalReason.QUEUE_TIMEOUT, now)
        if request.ttft_deadline is None:
            return None
        if now >= request.ttft_deadline:
            return _refusal(request, RefusalReason.TTFT_SLO, now)
        expected = self._expected(request, now, ahead)
        if expected is not None and expected > request.ttft_deadline:
            return _refusal(request, RefusalReason.TTFT_SLO_EARLY, now, expected)
        return None

    def _expected(self, request: Request, now: float, ahead: float | None) -> float | None:
        """When its first token should come, or None without an estimate (or at its admission: a request that
        can still make it by its deadline is given the chance, whatever a noisy estimate of one prefill says)."""
        if not self.settings.early_abort or ahead is None:
            return None
        prefill = self.meter.prefill_s(request.num_tokens)
        rate = self.meter.admitted_per_s()
        if rate is None:
            return None
        return now + (ahead + 1.0) / rate + prefill


def _refusal(request: Request, reason: RefusalReason, now: float, expected: float | None = None) -> SloRefusedError:
    arrival = request.arrival_time
    if reason == RefusalReason.QUEUE_TIMEOUT:
        timeout = (request.queue_deadline or arrival) - arrival
        message = f"queue_timeout_s={timeout:g} s passed while it waited"
    else:
        message = f"its first token cannot come within ttft_slo_s={request.ttft_slo_s:g} s: "
        if expected is None:
            message += f"it waited {now - arrival:.3g} s"
        else:
            message += f"expected {expected - arrival:.3g} s after arrival at the measured rates"
    return SloRefusedError(f"request {request.request_id!r} refused: {message}", reason.value)
