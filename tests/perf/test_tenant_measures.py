"""The tenant-isolation measures of a run's records: first-token p90 by phase of the arrival window."""

from __future__ import annotations

import pytest

from perf.metrics import RequestRecord
from perf.tenant_measures import PHASES, compare_noisy, tenant_figures


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
