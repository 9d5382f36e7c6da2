"""What a tenant-isolation run measured, from its request records: pure functions, shared by the in-process
(perf/bench_tenants.py) and the served (perf/bench_tenants_served.py) benchmarks.

A record's tenant is its adapter (the base model's requests: "<base>"). Service is counted in the fair policy's
cost: `prompt_cost` per prompt token when the first token comes, `output_cost` per output token as it streams. A
tenant is backlogged from a request's arrival to its first token.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from perf.metrics import RequestRecord

BASE_TENANT = "<base>"

Spans = list[tuple[float, float]]


def tenant_of(record: RequestRecord) -> str:
    return record.adapter or BASE_TENANT


def tenant_figures(records: list[RequestRecord], window: float) -> dict[str, dict[str, Any]]:
    """Per tenant: requests, finished, output tokens per second while requests arrived ([0, window]: a run with a
    noisy tenant drains its backlog for longer, which a whole-run average would charge to everyone), share of all
    output tokens, first-token p50/p90."""
    by_tenant: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        by_tenant[tenant_of(r)].append(r)
    total = sum(r.num_output for r in records) or 1
    return {tenant: _figures(rs, window, total) for tenant, rs in sorted(by_tenant.items())}


SLOWEST = 3  # a tenant's requests with the latest first tokens, kept to tell a tail's cause (arrival, prompt)
# Thirds of the arrival window: a noisy tenant's ratio that comes from the flood's start (before the scheduler sees
# it as heavy) shows in the first, one from its steady state in all three.
PHASES = 3


def _figures(rs: list[RequestRecord], window: float, total: int) -> dict[str, Any]:
    served = [(r.ttft, r) for r in rs if r.ok and r.ttft is not None]
    ttfts = [ttft for ttft, _ in served]
    slowest = [r for _, r in sorted(served, key=lambda pair: -pair[0])[:SLOWEST]]
    in_window = sum(k for r in rs for t, k in zip(r.chunk_times, r.chunk_tokens) if t <= window)
    return {
        "requests": len(rs),
        "finished": sum(1 for r in rs if r.ok),
        "output_tokens": sum(r.num_output for r in rs),
        "output_tok_s": in_window / window if window > 0 else 0.0,
        "share": sum(r.num_output for r in rs) / total,
        "ttft_p50_s": float(np.percentile(ttfts, 50)) if ttfts else None,
        "ttft_p90_s": float(np.percentile(ttfts, 90)) if ttfts else None,
        "ttfts_s": sorted(round(t, 5) for t in ttfts),  # for the ratio's interval (compare_noisy)
        "ttft_slowest": [{"arrival_s": r.arrival, "ttft_s": r.ttft, "input_len": r.input_len} for r in slowest],
        "ttft_p90_by_phase_s": _p90_by_phase(served, window),
    }


def _p90_by_phase(served: list[tuple[float, RequestRecord]], window: float) -> list[float | None]:
    """First-token p90 of the requests arriving in each PHASES-th of [0, window) (later arrivals in the last)."""
    phases: list[list[float]] = [[] for _ in range(PHASES)]
    for ttft, r in served:
        k = int(r.arrival * PHASES / window) if window > 0 else 0
        phases[min(max(k, 0), PHASES - 1)].append(ttft)
    return [float(np.percentile(p, 90)) if p else None for p in phases]


def service_gap(records: list[RequestRecord], duration: float, window: float, costs: tuple[float, float]) -> float:
    """The largest service difference between two tenants both backlogged over a whole window (windows of
    `window` seconds every window / 2): VTC's measure of fairness, in weighted tokens."""
    service, backlog = _service_events(records, costs)
    gap = 0.0
    start = 0.0
    while start + window <= duration + 1e-9:
        end = start + window
        served = [_served_within(*service[t], start, end) for t, spans in backlog.items() if _covers(spans, start, end)]
        if len(served) >= 2:
            gap = max(gap, max(served) - min(served))
        start += window / 2
    return gap


def _served_within(times: np.ndarray, cumulative: np.ndarray, start: float, end: float) -> float:
    lo, hi = np.searchsorted(times, [start, end])  # events in [start, end)
    return float(cumulative[hi] - cumulative[lo])


def _service_events(
    records: list[RequestRecord], costs: tuple[float, float]
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, Spans]]:
    """Per tenant: its service events as sorted times with cumulative service (from 0), and its backlogged spans
    (a request's arrival to its first token, or to its end if it had none)."""
    prompt_cost, output_cost = costs
    events: dict[str, list[tuple[float, float]]] = defaultdict(list)
    backlog: dict[str, Spans] = defaultdict(list)
    for r in records:
        tenant = tenant_of(r)
        end = r.chunk_times[0] if r.chunk_times else (r.finish_time if r.finish_time is not None else r.arrival)
        backlog[tenant].append((r.arrival, end))
        if r.chunk_times:
            events[tenant].append((r.chunk_times[0], prompt_cost * r.input_len))
        events[tenant] += [(t, output_cost * k) for t, k in zip(r.chunk_times, r.chunk_tokens)]
    service = {}
    for tenant in backlog:
        ordered = sorted(events[tenant])
        times = np.array([t for t, _ in ordered], dtype=np.float64)
        service[tenant] = times, np.concatenate([[0.0], np.cumsum([c for _, c in ordered])])
    return service, {t: _merged(spans) for t, spans in backlog.items()}


def _merged(spans: Spans) -> Spans:
    out: Spans = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _covers(spans: Spans, start: float, end: float) -> bool:
    return any(a <= start and end <= b for a, b in spans)


def slo_figures(records: list[RequestRecord], duration: float, slo: float) -> dict[str, Any]:
    """SLO attainment of all offered requests and of the admitted ones (not refused), goodput (met / second)."""
    met = [r for r in records if r.ok and r.ttft is not None and r.ttft < slo]
    refused = [r for r in records if r.finish_reason == "rejected"]
    admitted = len(records) - len(refused)
    return {
        "slo_s": slo,
        "offered": len(records),
        "refused": len(refused),
        "met": len(met),
        "attainment_all": len(met) / len(records) if records else 0.0,
        "attainment_admitted": len(met) / admitted if admitted else None,
        "goodput_rps": len(met) / duration if duration > 0 else 0.0,
    }


def steady_rate(records: list[RequestRecord], low: float = 0.1, high: float = 0.8) -> float:
    """Completions per second between the `low` and `high` quantiles of the finish times."""
    ends = sorted(r.finish_time for r in records if r.ok and r.finish_time is not None)
    if len(ends) < 10:
        return len(ends) / ends[-1] if ends and ends[-1] > 0 else 0.0
    a, b = int(low * len(ends)), int(high * len(ends)) - 1
    return (b - a) / (ends[b] - ends[a]) if ends[b] > ends[a] else len(ends) / ends[-1]


THROUGHPUT_GOAL = 0.9  # issue 26, under fair: each well-behaved tenant's throughput ratio at least this
TTFT_P90_GOAL = 1.5  # and its first-token p90 ratio at most this
BOOTSTRAP = 2000  # resamples of each run's first tokens for a ratio's interval
INTERVAL = (5.0, 95.0)  # percentiles of the resampled ratios: a 90% interval


def compare_noisy(with_: dict[str, Any], without: dict[str, Any], quiet: list[str], noisy: str) -> dict[str, Any]:
    """Each well-behaved tenant's throughput and first-token p90 with the noisy tenant over without it, from the
    two runs' metrics (their `tenants` and `service_gap`). A tenant's p90 comes from its few dozen requests, so each
    ratio gets a bootstrap interval, and the tenants whose whole interval is past the goal (or within it) are
    counted: a worst ratio near the goal is then told from chance."""
    a, b = with_["tenants"], without["tenants"]
    rng = np.random.default_rng(0)
    per = {t: _ratios(a[t], b[t], rng) for t in quiet if t in a and t in b}
    ratios = [v["throughput_ratio"] for v in per.values() if v["throughput_ratio"] is not None]
    ttfts = [v["ttft_p90_ratio"] for v in per.values() if v["ttft_p90_ratio"] is not None]
    intervals = [v["ttft_p90_ratio_interval"] for v in per.values() if v["ttft_p90_ratio_interval"] is not None]
    worst = max(per.values(), key=lambda v: v["ttft_p90_ratio"] or 0.0, default=None)
    server = [v["server_ttft_p90_ratio"] for v in per.values() if v["server_ttft_p90_ratio"] is not None]
    return {
        "min_throughput_ratio": min(ratios) if ratios else None,  # the goal under fair: >= 0.9
        "max_ttft_p90_ratio": max(ttfts) if ttfts else None,  # goal: <= 1.5
        "ttft_p90_ratio_interval_of_worst": worst["ttft_p90_ratio_interval"] if worst else None,
        "tenants_within_ttft_goal": sum(1 for r in ttfts if r <= TTFT_P90_GOAL),
        "tenants_surely_past_ttft_goal": sum(1 for lo, _ in intervals if lo > TTFT_P90_GOAL),
        "tenants_surely_within_ttft_goal": sum(1 for _, hi in intervals if hi <= TTFT_P90_GOAL),
        # the same ratio of the server's own first tokens (served runs): the part the engine makes
        "max_server_ttft_p90_ratio": max(server) if server else None,
        "median_server_ttft_p90_ratio": float(np.median(server)) if server else None,
        "ttft_p90_ratio_by_phase": _phase_ratios(a, b, quiet),
        "noisy_share": a.get(noisy, {}).get("share"),
        "service_gap_with": with_["service_gap"],
        "service_gap_without": without["service_gap"],
        "tenants": per,
    }


def _phase_ratios(with_: dict[str, Any], without: dict[str, Any], quiet: list[str]) -> list[dict[str, float | None]]:
    """Per phase of the arrival window: the largest and the median of the quiet tenants' first-token p90 ratios
    over that phase's arrivals (each p90 of a third of a tenant's requests: a coarse view of when the ratio
    arises, not the goal's figure)."""
    out = []
    for k in range(PHASES):
        ratios = []
        for t in quiet:
            a = with_.get(t, {}).get("ttft_p90_by_phase_s", [None] * PHASES)[k]
            b = without.get(t, {}).get("ttft_p90_by_phase_s", [None] * PHASES)[k]
            if a is not None and b:
                ratios.append(a / b)
        out.append({"max": max(ratios) if ratios else None,
                    "median": float(np.median(ratios)) if ratios else None})  # fmt: skip
    return out


def _ratios(with_: dict[str, Any], without: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    interval = p90_ratio_interval(with_.get("ttfts_s") or [], without.get("ttfts_s") or [], rng)
    return {"throughput_ratio": _ratio(with_, without, "output_tok_s"),
            "ttft_p90_ratio": _ratio(with_, without, "ttft_p90_s"), "ttft_p90_ratio_interval": interval,
            "server_ttft_p90_ratio": _ratio(with_, without, "server_ttft_p90_s")}  # fmt: skip


def _ratio(with_: dict[str, Any], without: dict[str, Any], key: str) -> float | None:
    """with_[key] / without[key]; None where either is missing or the divisor is 0."""
    a, b = with_.get(key), without.get(key)
    return a / b if a is not None and b else None


def p90_ratio_interval(with_: list[float], without: list[float], rng: np.random.Generator) -> list[float] | None:
    """The INTERVAL of p90(with) / p90(without) over BOOTSTRAP resamples of each run's first tokens (None with
    fewer than 10 in either: too few for a p90)."""
    if len(with_) < 10 or len(without) < 10:
        return None
    a = np.percentile(rng.choice(np.asarray(with_), (BOOTSTRAP, len(with_))), 90, axis=1)
    b = np.percentile(rng.choice(np.asarray(without), (BOOTSTRAP, len(without))), 90, axis=1)
    lo, hi = np.percentile(a / np.maximum(b, 1e-9), INTERVAL)
    return [float(lo), float(hi)]
