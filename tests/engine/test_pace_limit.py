"""The heavy tenants' cap (backend/engine/pace_limit.py): it judges the mean of every step, the steps that computed
prompts included, where the cap of all running requests (batch_limit.py) judges the median of decode-only steps."""

from __future__ import annotations

import statistics

import pytest

from slora.backend.engine.batch_limit import FLOOR, WINDOW, BatchLimiter
from slora.backend.engine.pace_limit import PaceLimiter
from slora.backend.engine.step_clock import Step

TARGET_S = 0.012


def _window(limiter: BatchLimiter, steps: list[Step], held: bool = True) -> None:
    for step in steps:
        limiter.observe(step, held)


def _mixed(decode_s: float, prompt_s: float, batch: int, every: int = 4) -> list[Step]:
    """WINDOW steps of `batch` requests, every `every`-th of them computing 512 prompt tokens."""
    return [Step(prompt_s, 512, batch) if k % every == every - 1 else Step(decode_s, 0, batch) for k in range(WINDOW)]


def test_steps_with_prompts_slow_the_pace_and_cut_the_cap() -> None:
    """Decode steps under the target, one step in four computing prompts: the mean is over it, the median is not."""
    steps = _mixed(0.008, 0.03, 100)
    mean = statistics.fmean(s.seconds for s in steps)
    assert mean == pytest.approx(0.0135) and mean > TARGET_S > statistics.median(s.seconds for s in steps)
    pace, decodes = PaceLimiter(TARGET_S, 256), BatchLimiter(TARGET_S, 256)
    _window(pace, steps)
    _window(decodes, steps)
    assert pace.cap == int(100 * TARGET_S / mean) == 88
    assert decodes.cap == 256, "the cap of all running requests waits for decode-only steps"


def test_the_pace_is_the_mean_of_the_window_once_it_is_full() -> None:
    pace = PaceLimiter(TARGET_S, 256)
    steps = _mixed(0.004, 0.02, 50)
    _window(pace, steps[:-1])
    assert pace.step_s is None and pace.cap == 256, "no verdict before a window of steps"
    _window(pace, steps[-1:])
    assert pace.step_s == pytest.approx(statistics.fmean(s.seconds for s in steps))


def test_a_pace_far_over_the_target_cuts_by_floor_and_the_draining_batch_is_left_out() -> None:
    pace = PaceLimiter(TARGET_S, 256)
    _window(pace, _mixed(0.03, 0.1, 100))
    assert pace.cap == int(100 * FLOOR) == 80
    for batch in range(99, 80, -1):  # draining down to the cap: its slow steps do not cut again
        _window(pace, _mixed(0.03, 0.1, batch)[: WINDOW - 1])
    assert pace.cap == 80


def test_a_pace_under_the_target_grows_the_cap_only_while_it_holds_requests_back() -> None:
    pace = PaceLimiter(TARGET_S, 256)
    pace.cap = 60
    _window(pace, _mixed(0.009, 0.02, 60), held=False)
    assert pace.cap == 60, "nothing waits at the cap: no reason to grow"
    _window(pace, _mixed(0.009, 0.02, 60))  # mean 0.01175, under the target but over GROW_FAST_BELOW of it
    assert pace.cap == 60 + WINDOW


def test_the_pace_counts_what_the_device_does_not_see() -> None:
    """Steps of 8 ms on the device, 14 ms apart on the host (an eager step's launches that the GPU waited for):
    the heavy cap follows the 14 ms that a running request waits for each token."""
    steps = [Step(0.008, 0, 100, wall_s=0.014) for _ in range(WINDOW)]
    pace, decodes = PaceLimiter(TARGET_S, 256), BatchLimiter(TARGET_S, 256)
    _window(pace, steps)
    _window(decodes, steps)
    assert pace.cap == int(100 * TARGET_S / 0.014) == 85, "cut by the mean interval (the window then starts again)"
    assert decodes.cap == 256, "each step's own device time is under the target"
