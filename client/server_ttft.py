"""The server's own first-token times over a window, from two scrapes of its histogram
(`slora_time_to_first_token_seconds`: a request's arrival at the Triton model to its first token out of the engine).

A benchmark's client measures from its send to its receipt. The difference between the two is the path outside the
engine: gRPC, Triton's front end, the Python backend's queue, and the response's way back. Per run, the bucket
counts' growth between the scrapes gives the window's histogram, and its quantiles are interpolated linearly inside
their bucket, as Prometheus' histogram_quantile does: a value within the bucket's bounds, not a measured one.

    before = scrape_settled(url)   # client/steps.py: the step counters and these buckets, one page
    ...  # the run
    server_ttft(before, scrape_settled(url))   # {"requests": n, "p50_s": ..., "p90_s": ...}
"""

from __future__ import annotations

import math
import re

PREFIX = "ttft_le:"  # the keys parse_steps gives the buckets: PREFIX + the bound as the page writes it
BUCKET = re.compile(r'^slora_time_to_first_token_seconds_bucket\{le="([^"]+)"\}\s+(\S+)$')
QUANTILES = {"p50_s": 0.5, "p90_s": 0.9}


def parse_buckets(line: str) -> tuple[str, float] | None:
    """(key, cumulative count) of one bucket line of the page, or None for any other line."""
    m = BUCKET.match(line)
    return (PREFIX + m[1], float(m[2])) if m else None


def server_ttft(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float | None] | None:
    """The window's first tokens: their count and interpolated quantiles (None where none came, or a quantile
    falls in the +Inf bucket); None without both scrapes or without the histogram."""
    if before is None or after is None:
        return None
    bounds = sorted((float(key[len(PREFIX) :]), key) for key in after if key.startswith(PREFIX))
    if not bounds or not math.isinf(bounds[-1][0]):
        return None
    counts = [(bound, after[key] - before.get(key, 0.0)) for bound, key in bounds]
    total = counts[-1][1]
    out: dict[str, float | None] = {"requests": total}
    for name, q in QUANTILES.items():
        out[name] = _quantile(counts, q) if total > 0 else None
    return out


def _quantile(counts: list[tuple[float, float]], q: float) -> float | None:
    """counts: (upper bound, cumulative count) by bound, the last +Inf. The first bucket starts at 0."""
    rank = q * counts[-1][1]
    lower, below = 0.0, 0.0
    for bound, cumulative in counts:
        if cumulative >= rank and cumulative > below:
            if math.isinf(bound):
                return None
            return lower + (bound - lower) * (rank - below) / (cumulative - below)
        lower, below = bound, cumulative
    return None
