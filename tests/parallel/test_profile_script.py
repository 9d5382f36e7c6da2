"""perf/profile_tp_step.py runs (tiny model, CPU, 2 ranks) and reports each kind of collective per decode step."""

from __future__ import annotations

from perf.profile_tp_step import main


def test_profile_reports_base_and_lora_collectives() -> None:
    result = main(["--smoke"])
    base, lora = result["phases"]["base"], result["phases"]["lora"]
    assert "lora all-gather" not in base["collectives_ms"] and lora["collectives_ms"]["lora all-gather"] > 0
    assert base["calls_per_step"]["base all-reduce"] == 2 * 2  # o and down in each of the tiny model's 2 layers
    # S2 targets q, k, v, o: one all-gather (q/k/v) and one all-reduce (o) in each layer
    assert lora["calls_per_step"]["lora all-gather"] == lora["calls_per_step"]["lora all-reduce"] == 2
    assert 0 < result["lora_collectives_share_of_step"] < 1
