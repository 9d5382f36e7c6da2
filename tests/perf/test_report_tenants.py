"""The report's tenant tables, from metrics made by the suites' own measures (tenant_measures)."""

from __future__ import annotations

import numpy as np

from perf.metrics import RequestRecord
from perf.report_tenants import noisy_table, overload_table
from perf.tenant_measures import compare_noisy, slo_figures, tenant_figures


def _records(ttfts: dict[str, list[float]], refused: int = 0) -> list[RequestRecord]:
    records = []
    for tenant, values in ttfts.items():
        for ttft in values:
            r = RequestRecord(len(records), tenant, 10, 2, 0.01 * len(records))
            r.add_chunk(r.arrival + ttft, 2)
            r.finish(r.arrival + ttft + 0.01, "length")
            records.append(r)
    for _ in range(refused):
        r = RequestRecord(len(records), "a", 10, 2, 0.5)
        r.finish(0.6, "rejected", "refused: ttft_slo_s")
        records.append(r)
    return records


def _metrics(ttfts: dict[str, list[float]]) -> dict:
    return {"tenants": tenant_figures(_records(ttfts), 3.0), "service_gap": 0.0, "throughput_rps": 10.0}


def test_the_noisy_table_checks_each_light_tenant_against_the_goals() -> None:
    rng = np.random.default_rng(1)
    light = {t: list(rng.gamma(4.0, 0.015, 40)) for t in ("a", "b")}
    without = _metrics(light)
    slowed = {"a": light["a"], "b": [2 * t for t in light["b"]], "noisy": [5.0] * 400}
    with_ = _metrics(slowed)
    for run, server_p90 in ((without, 0.04), (with_, 0.05)):  # as the server's tenant histograms gave them
        for figures in run["tenants"].values():
            figures["server_ttft_p90_s"] = server_p90
    with_["vs_without"] = compare_noisy(with_, without, ["a", "b"], "noisy")
    rows = noisy_table([{"name": "x-noisy-fair-without", "metrics": without},
                        {"name": "x-noisy-fair-with", "metrics": with_}])  # fmt: skip
    assert len(rows) == 4
    cells = [c.strip() for c in rows[3].split("|")[1:-1]]
    assert cells[0] == "x-noisy-fair-with" and cells[-1] == "NO"  # tenant b's p90 doubled
    assert cells[4].startswith("2.000; ") and cells[4].endswith("1 of 2")
    low, high = (float(x) for x in cells[5].split("–"))
    assert 1.5 < low < 2.0 < high
    assert cells[6] == "1 / 1"  # b surely past 1.5, a surely within
    assert "5.000" not in cells[2]  # the noisy tenant is not in the light range
    assert cells[7] == "1.250; 1.250"


def test_the_overload_table_shows_attainment_and_goodput() -> None:
    records = _records({"a": [0.1] * 8, "b": [7.0] * 2}, refused=3)
    metrics = {"load": 2.0, "num_finished": 10, "throughput_rps": 5.0, "goodput_over_capacity": 0.8,
               "ttft_s": {"p50": 0.1, "p90": 7.0, "p99": 7.0}, "slo": slo_figures(records, 10.0, 6.0)}  # fmt: skip
    rows = overload_table([{"name": "x-overload-2x-early-abort", "metrics": metrics}, {"name": "other", "metrics": {}}])
    assert len(rows) == 3
    cells = [c.strip() for c in rows[2].split("|")[1:-1]]
    assert cells[1:4] == ["2", "10", "3"]
    assert cells[6] == "0.615, 0.800"  # 8 of 13 offered met the SLO, 8 of the 10 admitted
    assert cells[7] == "0.80" and cells[8] == "0.80"
    assert cells[9] == "–"  # no fcfs run at this load to compare with


def test_the_overload_table_divides_goodput_by_fcfs_completions_at_the_same_load() -> None:
    abort = _records({"a": [0.1] * 8}, refused=3)
    queued = _records({"a": [0.1] * 2, "b": [7.0] * 8})
    runs = [
        {"name": f"x-overload-{load:g}x-{mode}",
         "metrics": {"load": load, "num_finished": 10, "throughput_rps": rate, "goodput_over_capacity": None,
                     "ttft_s": {}, "slo": slo_figures(records, 10.0, 6.0)}}
        for load, mode, rate, records in ((2.0, "fcfs", 1.0, queued), (2.0, "early-abort", 0.9, abort),
                                          (1.0, "early-abort", 0.9, abort))
    ]  # fmt: skip
    rows = overload_table(runs)
    last = {row.split("|")[1].strip(): [c.strip() for c in row.split("|")[1:-1]][-1] for row in rows[2:]}
    assert last["x-overload-2x-fcfs"] == "0.200"  # 2 of its 10 met the SLO in 10 s, over its own 1.0 req/s
    assert last["x-overload-2x-early-abort"] == "0.800"  # 8 met in 10 s, over fcfs's 1.0 req/s at 2x
    assert last["x-overload-1x-early-abort"] == "–"  # fcfs did not run at 1x
