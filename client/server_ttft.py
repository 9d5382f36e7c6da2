"""The server's own first-token times over a window, from two scrapes of its histogram
(`slora_time_to_first_token_seconds`: a request's arrival at the Triton model to its first token out of the engine).

A benchmark's client measures from its send to its receipt. The difference between the two is the path outside the
engine: gRPC, Triton's front end, the Python backend's queue, and the response's way back. Per run, the bucket
counts' growth between the scrapes gives the window's histogram, and its quantiles are interpolated linearly inside
their bucket, as Prometheus' histogram_quantile does: a value within the bucket's bounds, not a measured one.

    before = scrape_settled(url)   # client/steps.py: the step counters and these buckets, one page
    ...  # the run
    server_ttft(before, scrape_settled(url))   # {"requests": n, "p50_s": ..., "p90_s": ...}
    server_ttft_by_tenant(before, after)        # the same per tenant (slora_tenant_time_to_first_token_seconds)
    responder_figures(before, after, seconds)   # the first token's way out of the model: its delay, the thread's load

The first-token histograms stop at the engine's output. The responder thread then turns it into a response; the
first response's delay (`slora_first_response_delay_seconds`) and the responder's busy time
(`slora_responder_busy_seconds_total`) tell how much of the time outside the engine is spent there, and whether the
thread keeps up.
"""

from __future__ import annotations

import math
import re

PREFIX = "ttft_le:"  # the keys parse_steps gives the buckets: PREFIX + the bound as the page writes it
TENANT_PREFIX = "tenant_ttft_le/"  # a tenant's: TENANT_PREFIX + tenant + "/" + bound (no tenant name has a "/")
DELAY_PREFIX = "delay_le:"  # the first response's delay: DELAY_PREFIX + bound
BUSY = "responder_busy_s"  # the key of the responder's busy-time counter
BUCKET = re.compile(r'^slora_time_to_first_token_seconds_bucket\{le="([^"]+)"\}\s+(\S+)$')
DELAY_BUCKET = re.compile(r'^slora_first_response_delay_seconds_bucket\{le="([^"]+)"\}\s+(\S+)$')
BUSY_LINE = re.compile(r"^slora_responder_busy_seconds_total(?:\{\})?\s+(\S+)$")
TENANT_BUCKET = re.compile(r"^slora_tenant_time_to_first_token_seconds_bucket\{([^}]*)\}\s+(\S+)$")
LABEL = re.compile(r'(\w+)="([^"]*)"')
QUANTILES = {"p50_s": 0.5, "p90_s": 0.9}


def parse_buckets(line: str) -> tuple[str, float] | None:
    """(key, cumulative count) of one bucket line of the page (all requests' or a tenant's), or None for any
    other line."""
    if m := BUCKET.match(line):
        return PREFIX + m[1], float(m[2])
    if m := DELAY_BUCKET.match(line):
        return DELAY_PREFIX + m[1], float(m[2])
    if m := BUSY_LINE.match(line):
        return BUSY, float(m[1])
    if m := TENANT_BUCKET.match(line):
        labels = dict(LABEL.findall(m[1]))
        if "tenant" in labels and "le" in labels:
            return f"{TENANT_PREFIX}{labels['tenant']}/{labels['le']}", float(m[2])
    return None


def server_ttft(
    before: dict[str, float] | None, after: dict[str, float] | None, prefix: str = PREFIX
) -> dict[str, float | None] | None:
    """The window's first tokens (of the histogram whose buckets parse_buckets keys with `prefix`: all requests',
    a tenant's, the first responses' delay): their count and interpolated quantiles (None where none came, or a
    quantile falls in the +Inf bucket); None without both scrapes or without the histogram."""
    if before is None or after is None:
        return None
    bounds = sorted((float(key[len(prefix) :]), key) for key in after if key.startswith(prefix))
    if not bounds or not math.isinf(bounds[-1][0]):
        return None
    counts = [(bound, after[key] - before.get(key, 0.0)) for bound, key in bounds]
    total = counts[-1][1]
    out: dict[str, float | None] = {"requests": total}
    for name, q in QUANTILES.items():
        out[name] = _quantile(counts, q) if total > 0 else None
    return out


def server_ttft_by_tenant(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, dict[str, float | None]]:
    """server_ttft of each tenant with a first token in the window (the server's tenant histograms)."""
    if before is None or after is None:
        return {}
    tenants = {key[len(TENANT_PREFIX) :].rpartition("/")[0] for key in after if key.startswith(TENANT_PREFIX)}
    out = {}
    for tenant in sorted(tenants):
        figures = server_ttft(before, after, f"{TENANT_PREFIX}{tenant}/")
        if figures is not None and figures["requests"]:
            out[tenant] = figures
    return out


def responder_figures(
    before: dict[str, float] | None, after: dict[str, float] | None, seconds: float
) -> dict[str, float | None] | None:
    """The responder over a window of `seconds`: its busy share (busy time / window) and its first responses'
    delay (count, p50, p90); None without both scrapes or on a server without these series."""
    if before is None or after is None or BUSY not in after:
        return None
    delay = server_ttft(before, after, prefix=DELAY_PREFIX) or {}
    busy = after[BUSY] - before.get(BUSY, 0.0)
    return {
        "busy_share": busy / seconds if seconds > 0 else None,
        "first_responses": delay.get("requests"),
        "first_response_delay_p50_s": delay.get("p50_s"),
        "first_response_delay_p90_s": delay.get("p90_s"),
    }


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
