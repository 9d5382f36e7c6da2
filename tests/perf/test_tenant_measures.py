"""The tenant-isolation measures of a run's records: first-token p90 by phase of the arrival window, and the
bootstrap interval of a tenant's p90 ratio."""

from __future__ import annotations

import numpy as np
import pytest

from perf.metrics import RequestRecord
from perf.tenant_measures import PHASES, TTFT_P90_GOAL, compare_noisy, p90_ratio_interval, tenant_figures


def _served(index: int, tenant: str, arrival: float, ttft: float) -> RequestRecord:
    record = RequestRecord(index, tenant, input_len=10, output_len=2, arrival=arrival)
    record.add_chunk(arrival + ttft, 1)
    record.add_chunk(arrival + ttft + 0.01, 1)
    record.finish(arrival + ttft + 0.01, "length")
    return record


def _run(ttfts_by_phase: list[float], window: float = 3.0) -> list[RequestRecord]:
    """Ten requests of tenant `q` in each phase of [0, window), each phase's first tokens at its own latency."""
    records = []
    for k, ttft in enumerate(ttfts_by_phase):
        for i in range(10):
            arrival = (k + i / 10) * window / PHASES
            records.append(_served(len(records), "q", arrival, ttft))
    return records


def test_p90_by_phase_splits_the_arrival_window() -> None:
    assert PHASES == 3
    figures = tenant_figures(_run([0.1, 0.2, 0.4]), window=3.0)["q"]
    assert figures["ttft_p90_by_phase_s"] == pytest.approx([0.1, 0.2, 0.4])
    late = [_served(0, "q", 3.5, 0.8)]  # arrived after the window: counted in the last phase
    assert tenant_figures(late, window=3.0)["q"]["ttft_p90_by_phase_s"] == [None, None, pytest.approx(0.8)]


def test_an_empty_phase_has_no_p90() -> None:
    records = [_served(0, "q", 0.2, 0.1), _served(1, "q", 2.5, 0.3)]
    assert tenant_figures(records, window=3.0)["q"]["ttft_p90_by_phase_s"] == [
        pytest.approx(0.1),
        None,
        pytest.approx(0.3),
    ]


def test_phase_ratios_show_when_the_slowdown_came() -> None:
    """A flood that slows only the first third: its ratio shows there, the later thirds stay at 1."""
    without = {"tenants": tenant_figures(_run([0.1, 0.1, 0.1]), 3.0), "service_gap": 0.0}
    with_ = {"tenants": tenant_figures(_run([0.3, 0.1, 0.1]), 3.0), "service_gap": 0.0}
    phases = compare_noisy(with_, without, ["q"], "noisy")["ttft_p90_ratio_by_phase"]
    assert [p["max"] for p in phases] == pytest.approx([3.0, 1.0, 1.0])
    assert [p["median"] for p in phases] == pytest.approx([3.0, 1.0, 1.0])
    assert compare_noisy(with_, without, ["absent"], "noisy")["ttft_p90_ratio_by_phase"][0] == {
        "max": None,
        "median": None,
    }


def _tenant(ttfts: list[float]) -> list[RequestRecord]:
    return [_served(i, "q", 0.01 * i, ttft) for i, ttft in enumerate(ttfts)]


def _compare(with_ttfts: list[float], without_ttfts: list[float]) -> dict:
    with_ = {"tenants": tenant_figures(_tenant(with_ttfts), 3.0), "service_gap": 0.0}
    without = {"tenants": tenant_figures(_tenant(without_ttfts), 3.0), "service_gap": 0.0}
    return compare_noisy(with_, without, ["q"], "noisy")


def test_a_ratio_of_one_load_twice_has_an_interval_around_one() -> None:
    rng = np.random.default_rng(3)
    same = _compare(list(rng.gamma(4.0, 0.015, 60)), list(rng.gamma(4.0, 0.015, 60)))
    lo, hi = same["ttft_p90_ratio_interval_of_worst"]
    assert lo < 1.0 < hi and lo <= same["max_ttft_p90_ratio"] <= hi
    assert same["tenants_surely_past_ttft_goal"] == 0 and same["tenants_within_ttft_goal"] == 1


def test_a_doubled_first_token_is_surely_past_the_goal() -> None:
    rng = np.random.default_rng(4)
    base = list(rng.gamma(4.0, 0.015, 60))
    slowed = _compare([2 * t for t in rng.gamma(4.0, 0.015, 60)], base)
    assert slowed["ttft_p90_ratio_interval_of_worst"][0] > TTFT_P90_GOAL
    assert slowed["tenants_surely_past_ttft_goal"] == 1 and slowed["tenants_surely_within_ttft_goal"] == 0
    few = _compare([0.2] * 5, [0.1] * 5)  # too few first tokens for a p90's interval
    assert few["ttft_p90_ratio_interval_of_worst"] is None and few["max_ttft_p90_ratio"] == pytest.approx(2.0)


def test_the_interval_follows_the_sample_size() -> None:
    """More requests a tenant, a narrower interval: why a longer run tells a miss from chance."""
    rng = np.random.default_rng(5)
    widths = []
    for n in (40, 400):
        lo, hi = p90_ratio_interval(list(rng.gamma(4.0, 0.015, n)), list(rng.gamma(4.0, 0.015, n)),
                                    np.random.default_rng(0))  # fmt: skip
        widths.append(hi - lo)
    assert widths[1] < 0.6 * widths[0]
