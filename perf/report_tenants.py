"""The report's tables of the tenant-isolation suites (perf/tenant_suites.py): the noisy neighbour's runs against
issue 26's goals, and the overload runs' SLO attainment and goodput.

A noisy-neighbour row is a run of the suite; the one with the noisy tenant compares the light tenants with the run
without it (its `vs_without`), and a run without it again compares the two runs without it: the noise of the
measure. Light tenants are those with at most HEAVY times the median tenant's requests.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from perf.tenant_clients import HEAVY
from perf.tenant_measures import THROUGHPUT_GOAL, TTFT_P90_GOAL

Run = dict[str, Any]


def noisy_table(runs: list[Run]) -> list[str]:
    lines = ["| run | req/s | light TTFT p50 / p90 range (s) | light throughput ratio (min; median) "
             f"| light TTFT p90 ratio (max; median; within {TTFT_P90_GOAL:g}) | worst's 90% interval "
             f"| surely past / surely within {TTFT_P90_GOAL:g} | server's TTFT p90 ratio (max; median) | noisy share "
             "| met |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for run in runs:
        if "-noisy-" not in run["name"]:
            continue
        m = run["metrics"]
        cells = [f"{m['throughput_rps']:.2f}", _light_range(m["tenants"]), *_comparison(m.get("vs_without"))]
        if run["name"].endswith("-without-again"):
            cells[-1] = "(repeat)"  # the noise of the measure, not a goal
        lines.append(f"| {run['name']} | {' | '.join(cells)} |")
    return lines if len(lines) > 2 else []


def _light_range(tenants: dict[str, dict[str, Any]]) -> str:
    light = _light(tenants)
    p50 = [f["ttft_p50_s"] for f in light if f["ttft_p50_s"] is not None]
    p90 = [f["ttft_p90_s"] for f in light if f["ttft_p90_s"] is not None]
    if not p50 or not p90:
        return "–"
    return f"{min(p50):.3f}–{max(p50):.3f} / {min(p90):.3f}–{max(p90):.3f}"


def _light(tenants: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    median = float(np.median([f["requests"] for f in tenants.values()])) if tenants else 0.0
    return [f for f in tenants.values() if f["requests"] <= HEAVY * median]


def _comparison(vs: dict[str, Any] | None) -> list[str]:
    if not vs:
        return ["", "", "", "", "", "", ""]
    per = vs["tenants"].values()
    throughput = [t["throughput_ratio"] for t in per if t["throughput_ratio"] is not None]
    ttft = [t["ttft_p90_ratio"] for t in per if t["ttft_p90_ratio"] is not None]
    interval = vs.get("ttft_p90_ratio_interval_of_worst")
    met = bool(throughput and ttft) and min(throughput) >= THROUGHPUT_GOAL and max(ttft) <= TTFT_P90_GOAL
    return [
        f"{min(throughput):.3f}; {np.median(throughput):.3f}" if throughput else "–",
        f"{max(ttft):.3f}; {np.median(ttft):.3f}; {sum(r <= TTFT_P90_GOAL for r in ttft)} of {len(ttft)}"
        if ttft
        else "–",
        f"{interval[0]:.2f}–{interval[1]:.2f}" if interval else "–",
        f"{vs.get('tenants_surely_past_ttft_goal', '–')} / {vs.get('tenants_surely_within_ttft_goal', '–')}",
        f"{fmt(vs.get('max_server_ttft_p90_ratio'), 3)}; {fmt(vs.get('median_server_ttft_p90_ratio'), 3)}",
        fmt(vs.get("noisy_share")),
        "yes" if met else "NO",
    ]


def overload_table(runs: list[Run]) -> list[str]:
    """One row an overload run; goodput over the capacity given or measured by the burst, and over what fcfs
    completed on the same trace at the same load (the capacity that overload itself shows, where fcfs ran)."""
    lines = ["| run | load | finished | refused | req/s | TTFT p50 / p90 / p99 (s) | SLO met: of all, of admitted "
             "| goodput req/s | goodput / capacity | goodput / fcfs's req/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    fcfs = _fcfs_rates(runs)
    for run in runs:
        m = run["metrics"]
        if "load" not in m or "slo" not in m:
            continue
        slo, ttft = m["slo"], m.get("ttft_s") or {}
        cells = [
            f"{m['load']:g}",
            str(m["num_finished"]),
            str(slo["refused"]),
            f"{m['throughput_rps']:.2f}",
            " / ".join(fmt(ttft.get(q)) for q in ("p50", "p90", "p99")),
            f"{slo['attainment_all']:.3f}, {fmt(slo['attainment_admitted'], 3)}",
            f"{slo['goodput_rps']:.2f}",
            fmt(m.get("goodput_over_capacity")),
            fmt(slo["goodput_rps"] / fcfs[m["load"]] if fcfs.get(m["load"]) else None, 3),
        ]
        lines.append(f"| {run['name']} | {' | '.join(cells)} |")
    return lines if len(lines) > 2 else []


def _fcfs_rates(runs: list[Run]) -> dict[float, float]:
    """fcfs's completions per second at each load it ran: under overload, the most this server served of the
    trace, so goodput over it needs no separate capacity measure."""
    return {run["metrics"]["load"]: run["metrics"]["throughput_rps"] for run in runs
            if run["name"].endswith("x-fcfs") and "load" in run["metrics"]}  # fmt: skip


def fmt(value: Any, digits: int = 2) -> str:
    """A figure for a table cell, with a dash where none was measured."""
    return "–" if value is None else f"{value:.{digits}f}"
