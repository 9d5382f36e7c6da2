"""The HF PEFT baseline runs a bounded prefix of a trace, one adapter at a time, with the same metrics."""

from __future__ import annotations

from pathlib import Path

import torch

from perf import baseline_peft
from perf.results import load_results
from perf.workload import TraceConfig, generate_trace, save_trace


def test_peft_baseline_serves_a_bounded_prefix(tiny_model: Path, tiny_adapters: Path, tmp_path: Path) -> None:
    config = TraceConfig(num_adapters=3, req_rate=100, duration=0.12, input_range=(4, 12), output_range=(2, 8),
                         vocab_size=1024, adapter_prefix="s1-", seed=5)  # fmt: skip
    lora = save_trace(generate_trace(config), tmp_path / "lora.jsonl")
    base = save_trace(generate_trace(TraceConfig(**{**config.__dict__, "num_adapters": 0})), tmp_path / "base.jsonl")
    out = tmp_path / "r.json"
    baseline_peft.main(["--model", str(tiny_model), "--adapter-root", str(tiny_adapters), "--device", "cpu",
                        "--max-batch-size", "3", "--max-requests", "10", "--max-loaded", "2", "--out", str(out),
                        str(lora), str(base)])  # fmt: skip
    runs = {r["name"]: r for r in load_results(out)["runs"]}
    lora_run, base_run = runs["peft-lora"], runs["peft-base"]
    for run in (lora_run, base_run):
        m = run["metrics"]
        assert run["kind"] == "peft" and run["options"]["bounded_prefix"] == 10
        assert m["num_finished"] == 10 and m["num_short"] == 0 and m["throughput_rps"] > 0
        assert m["ttft_s"]["p50"] <= m["e2e_s"]["p50"]
    assert lora_run["metrics"]["adapter_loads"] >= lora_run["trace"]["distinct_adapters"] == 3
    assert base_run["metrics"]["adapter_loads"] == 0


def test_peft_time_limit_leaves_requests_unfinished(tiny_model: Path, tiny_adapters: Path, tmp_path: Path) -> None:
    config = TraceConfig(num_adapters=2, req_rate=100, duration=0.1, input_range=(4, 12), output_range=(2, 8),
                         vocab_size=1024)  # fmt: skip
    trace = generate_trace(config)
    model = baseline_peft.load_model(tiny_model, torch.device("cpu"), torch.float32)
    switcher = baseline_peft.AdapterSwitcher(model, tiny_adapters, max_loaded=0)
    records, duration = baseline_peft.replay(switcher, trace, baseline_peft.PeftOptions(time_limit_s=1e-3))
    assert duration > 0 and sum(1 for r in records if r.finish_time is None) > 0
