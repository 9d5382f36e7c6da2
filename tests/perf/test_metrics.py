"""The summary metrics: S-LoRA's satisfaction and SLO attainment, latencies, throughput."""

from __future__ import annotations

import pytest

from perf.metrics import RequestRecord, attained, satisfaction, summarize


def test_satisfaction_and_attainment_follow_s_lora() -> None:
    assert satisfaction(0.0) == 1.0
    assert satisfaction(3.0) == pytest.approx(0.75)
    assert satisfaction(5.999) > 0.0
    assert satisfaction(6.0) == 0.0 and satisfaction(None) == 0.0
    assert attained(5.9) == 1.0 and attained(6.0) == 0.0 and attained(None) == 0.0


def _record(index: int, arrival: float, times: list[float], tokens: list[int] | None = None) -> RequestRecord:
    record = RequestRecord(index, "a", input_len=10, output_len=sum(tokens or [1] * len(times)), arrival=arrival)
    for t, k in zip(times, tokens or [1] * len(times)):
        record.add_chunk(t, k)
    record.finish(times[-1], "length")
    return record


def test_summary_of_known_records() -> None:
    records = [
        _record(0, 0.0, [1.0, 2.0, 3.0]),  # ttft 1, tpot 1, e2e 3
        _record(1, 1.0, [4.0, 8.0], tokens=[1, 2]),  # ttft 3, itl 2, 2
        RequestRecord(2, "b", 10, 5, arrival=2.0),  # never finished
    ]
    m = summarize(records, duration=10.0)
    assert m["num_requests"] == 3 and m["num_finished"] == 2 and m["num_unfinished"] == 1
    assert m["throughput_rps"] == pytest.approx(0.2)
    assert m["output_tok_s"] == pytest.approx(0.6)
    assert m["total_tok_s"] == pytest.approx(2.6)
    assert m["ttft_s"]["mean"] == pytest.approx(2.0)
    assert m["e2e_s"]["p50"] == pytest.approx(5.0)
    assert m["itl_s"]["mean"] == pytest.approx((1 + 1 + 2 + 2) / 4)
    assert m["tpot_s"]["mean"] == pytest.approx((1.0 + 2.0) / 2)
    assert m["slo_attainment"] == pytest.approx(2 / 3)
    assert m["user_satisfaction"] == pytest.approx((1 - 1 / 36 + 1 - 9 / 36) / 3)


def test_summary_against_another_slo() -> None:
    """A run with its own first-token SLO (the tenant suites') counts attainment and satisfaction against it."""
    records = [_record(0, 0.0, [1.0, 2.0]), _record(1, 1.0, [4.0, 5.0])]  # first tokens after 1 s and 3 s
    m = summarize(records, duration=10.0, slo_s=2.0)
    assert m["slo_ttft_s"] == 2.0
    assert m["slo_attainment"] == pytest.approx(1 / 2)
    assert m["user_satisfaction"] == pytest.approx((1 - 1 / 4) / 2)


def test_empty_and_failed_runs_do_not_crash() -> None:
    failed = RequestRecord(0, None, 5, 5, arrival=0.0)
    failed.finish(0.1, "error", "adapter missing")
    m = summarize([failed])
    assert m["num_failed"] == 1 and m["num_finished"] == 0 and m["throughput_rps"] == 0.0
    assert m["ttft_s"]["p99"] is None
    assert summarize([])["num_requests"] == 0
