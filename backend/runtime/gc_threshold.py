"""How often Python's cyclic collector runs while an engine serves: its young generation's threshold raised from
CPython's 700 allocations to YOUNG_THRESHOLD.

One engine step allocates over a thousand tracked objects that live until the step ends (the scheduled sequences,
their page-table rows, the batch's lists), one per running request or more. With a threshold of 700 a young
collection runs in the middle of nearly every step and walks all of them, and every tenth one the next generation as
well: host time the GPU may wait for (perf/bench_host_step.py counts it). Reference counting frees nearly all of them
when the step ends, so a threshold above one step's peak leaves these collections rare, while cyclic garbage is still
collected, at most YOUNG_THRESHOLD allocations later.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

# Above the tracked objects of a step at max_num_seqs (a few per request) on the largest batches the engine plans
YOUNG_THRESHOLD = 20_000


def raise_young_threshold() -> tuple[int, ...]:
    """Set the young generation's threshold to YOUNG_THRESHOLD (unless already higher: a host's own choice stays);
    returns the thresholds before."""
    before = gc.get_threshold()
    if before[0] != 0 and before[0] < YOUNG_THRESHOLD:  # 0: the collector's automatic runs are off; keep them so
        gc.set_threshold(YOUNG_THRESHOLD, *before[1:])
        logger.info("garbage collector: young generation threshold %d (was %d)", YOUNG_THRESHOLD, before[0])
    return before


@contextmanager
def young_threshold_raised() -> Iterator[None]:
    """raise_young_threshold for the duration of the block (a benchmark's measured run), then the thresholds before."""
    before = raise_young_threshold()
    try:
        yield
    finally:
        gc.set_threshold(*before)
