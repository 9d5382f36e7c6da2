"""bench_tenants: its smoke mode runs every suite on the tiny model and writes complete results; its measures
(per-tenant traces, the service gap, SLO figures) are right on hand-made records."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from perf import bench_tenants
from perf.metrics import RequestRecord
from perf.results import load_results


def test_smoke_runs_every_suite(tmp_path: Path) -> None:
    out = tmp_path / "tenants.json"
    bench_tenants.main(["--smoke", "--duration", "0.6", "--loads", "1", "4", "--capacity-requests", "12",
                        "--time-limit", "30", "--out", str(out)])  # fmt: skip
    runs = {r["name"]: r for r in load_results(out)["runs"]}
    expected = {"tenants-capacity"}
    expected |= {f"tenants-noisy-{p}-{w}" for p in ("fcfs", "fair") for w in ("with", "without")}
    expected |= {f"tenants-overload-{load}x-{m}" for load in ("1", "4") for m in bench_tenants.SMOKE.modes}
    assert set(runs) == expected
    capacity = runs["tenants-capacity"]["metrics"]
    assert capacity["num_finished"] == 12 and capacity["capacity_rps"] > 0
    for name, run in runs.items():
        m = run["metrics"]
        assert run["kind"] == "engine" and run["group"] == "tenants"
        assert m["num_finished"] + m["slo"]["refused"] == m["num_requests"] == m["slo"]["offered"], name
        assert 0 <= m["slo"]["attainment_all"] <= 1 and m["service_gap"] >= 0
        assert sum(t["requests"] for t in m["tenants"].values()) == m["num_requests"]
    for policy in ("fcfs", "fair"):
        comparison = runs[f"tenants-noisy-{policy}-with"]["metrics"]["vs_without"]
        assert set(comparison) >= {"min_throughput_ratio", "max_ttft_p90_ratio", "noisy_share", "tenants"}
        assert runs[f"tenants-noisy-{policy}-with"]["options"]["engine"]["scheduling_policy"] == policy
    for load in ("1", "4"):
        early = runs[f"tenants-overload-{load}x-early-abort"]
        assert early["options"]["engine"]["ttft_slo_s"] == bench_tenants.SMOKE.slo_s
        assert early["metrics"]["load"] == float(load) and early["metrics"]["goodput_over_capacity"] >= 0
        assert runs[f"tenants-overload-{load}x-fcfs"]["metrics"]["slo"]["refused"] == 0
    json.dumps(load_results(out))


def test_repeat_without_compares_a_second_quiet_run_with_the_first(tmp_path: Path) -> None:
    out = tmp_path / "tenants.json"
    bench_tenants.main(["--smoke", "--suite", "noisy", "--policies", "fair", "--repeat-without", "--duration", "0.6",
                        "--capacity-requests", "12", "--time-limit", "30", "--out", str(out)])  # fmt: skip
    runs = {r["name"]: r for r in load_results(out)["runs"]}
    assert set(runs) == {"tenants-capacity", *(f"tenants-noisy-fair-{w}" for w in ("without", "with", "without-again"))}
    first, again = runs["tenants-noisy-fair-without"]["metrics"], runs["tenants-noisy-fair-without-again"]["metrics"]
    assert again["num_requests"] == first["num_requests"]  # the same trace
    repeat = again["vs_without"]
    assert set(repeat["tenants"]) == set(first["tenants"]) and len(first["tenants"]) == bench_tenants.SMOKE.tenants
    for tenant, ratios in repeat["tenants"].items():
        p90s = (again["tenants"][tenant]["ttft_p90_s"], first["tenants"][tenant]["ttft_p90_s"])
        assert ratios["ttft_p90_ratio"] == pytest.approx(p90s[0] / p90s[1])
    summary = runs["tenants-noisy-fair-with"]["metrics"]["vs_without"]["repeat"]
    assert summary == {k: repeat[k] for k in ("min_throughput_ratio", "max_ttft_p90_ratio")}


def test_a_tenant_draws_the_same_requests_whoever_else_is_there() -> None:
    options = replace(bench_tenants.SMOKE, duration_s=5.0)
    quiet = bench_tenants.tenant_trace({"a": 3.0, "b": 3.0}, options, seed=1, vocab_size=100)
    loud = bench_tenants.tenant_trace({"a": 3.0, "b": 3.0, "noisy": 30.0}, options, seed=1, vocab_size=100)

    def of(trace: object, tenant: str) -> list[tuple[float, tuple[int, ...], int]]:
        return [(r.arrival, r.prompt_ids, r.output_len) for r in trace.requests if r.adapter == tenant]  # type: ignore[attr-defined]

    assert of(quiet, "a") == of(loud, "a") and of(quiet, "b") == of(loud, "b")
    assert len(of(loud, "noisy")) > 5 * len(of(loud, "a")) > 0
    assert [r.index for r in loud.requests] == list(range(len(loud)))
    assert all(x.arrival <= y.arrival for x, y in zip(loud.requests, loud.requests[1:]))


def _record(index: int, tenant: str, arrival: float, first: float, tokens: list[tuple[float, int]]) -> RequestRecord:
    record = RequestRecord(index, tenant, 10, sum(k for _, k in tokens), arrival)
    for t, k in [(first, tokens[0][1]), *tokens[1:]]:
        record.add_chunk(t, k)
    record.finish(tokens[-1][0], "length")
    return record


def test_service_gap_counts_only_windows_where_both_are_backlogged() -> None:
    # "a" waits over [0, 4) and is served 10 prompt + 3 tokens at 1.0; "b" waits over [0, 4) and gets nothing
    # until 3.5; after 4 neither is backlogged, so b's burst at 5 is not compared.
    records = [
        _record(0, "a", 0.0, 1.0, [(1.0, 1), (1.5, 2)]),
        _record(1, "a", 0.0, 4.0, [(4.0, 1)]),
        _record(2, "b", 0.0, 3.5, [(3.5, 1)]),
        _record(3, "b", 0.0, 4.0, [(4.0, 1), (5.0, 50)]),
    ]
    gap = bench_tenants.service_gap(records, duration=6.0, window=2.0, costs=(1.0, 2.0))
    assert gap == pytest.approx(10 + 2 * 3)  # window [1, 3): a served 16, b nothing
    assert bench_tenants.service_gap(records, duration=6.0, window=6.0, costs=(1.0, 2.0)) == 0.0


def test_slo_figures_split_refused_from_admitted() -> None:
    met = _record(0, "a", 0.0, 0.2, [(0.2, 1)])
    late = _record(1, "a", 0.0, 2.0, [(2.0, 1)])
    refused = RequestRecord(2, "a", 10, 5, 0.0)
    refused.finish(0.1, "rejected", "request 'r2' refused: ttft_slo_s=1 s")
    figures = bench_tenants.slo_figures([met, late, refused], duration=2.0, slo=1.0)
    assert figures["refused"] == 1 and figures["met"] == 1
    assert figures["attainment_all"] == pytest.approx(1 / 3) and figures["attainment_admitted"] == 0.5
    assert figures["goodput_rps"] == 0.5


def test_steady_rate_leaves_out_the_ramp_and_the_drain() -> None:
    records = []
    for i in range(100):  # 10 finish over the first 5 s, 70 at 10 a second, the last 20 over 20 s
        end = 0.5 * i if i < 10 else (5 + (i - 10) * 0.1 if i < 80 else 12 + (i - 80))
        record = RequestRecord(i, "a", 10, 1, 0.0)
        record.add_chunk(end, 1)
        record.finish(end, "length")
        records.append(record)
    assert bench_tenants.steady_rate(records) == pytest.approx(10.0)
