"""perf/pool_churn.py: the CPU model keeps the served shape's adapter pages against KV pages, and a replay under pool
pressure finishes every request of the trace while its counts add up; a trace of other adapters is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perf import pool_churn
from perf.make_model import LLAMA2_7B, ModelShape
from perf.workload import TraceConfig, generate_trace, save_trace


def adapter_rows_per_kv_token(shape: ModelShape) -> float:
    """Elements of a rank-1 adapter on all seven projections of a layer, over one token's K and V in that layer."""
    hidden, inter = shape.hidden_size, shape.intermediate_size
    kv = shape.num_key_value_heads * (hidden // shape.num_attention_heads)
    per_rank = 2 * (hidden + hidden) + 2 * (hidden + kv) + 2 * (hidden + inter) + (inter + hidden)
    return per_rank / (2 * kv)


def test_the_cpu_model_keeps_the_adapters_share_of_pages() -> None:
    small = pool_churn.cpu_shape(LLAMA2_7B)
    assert small.hidden_size < 256 and small.num_hidden_layers <= 4, "CPU widths"
    full, cpu = adapter_rows_per_kv_token(LLAMA2_7B), adapter_rows_per_kv_token(small)
    assert abs(cpu / full - 1) < 0.02, (full, cpu)


def test_a_replay_under_pool_pressure_finishes_every_request(tmp_path: Path) -> None:
    config = TraceConfig(num_adapters=8, req_rate=40.0, duration=1.0, input_range=(8, 40), output_range=(4, 24),
                         vocab_size=1024, adapter_prefix="sall-", seed=3)  # fmt: skip
    trace_path = save_trace(generate_trace(config), tmp_path / "trace.jsonl")
    out = tmp_path / "churn.json"
    churn = pool_churn.main(["--trace", str(trace_path), "--work", str(tmp_path / "work"), "--pool-pages", "150",
                             "--limit-s", "600", "--copy-ms", "2", "--engine-option", "max_num_seqs=16",
                             "--out", str(out)])  # fmt: skip
    assert churn.requests == churn.finished == config.num_requests, "nothing lost"
    assert churn.adapter_evictions > 0, "150 pages hold a few of the 8 S-all adapters beside the KV: they must churn"
    assert churn.adapter_loads - churn.adapter_evictions == churn.resident_at_end
    assert churn.clock_s >= churn.steps * 26.9 / 1000
    assert churn.options["max_num_seqs"] == "16" and churn.options["max_bypass"] == "8"
    assert json.loads(out.read_text())["loads_per_request"] == round(churn.adapter_loads / churn.requests, 3)


def test_a_trace_of_other_adapters_is_refused_by_name(tmp_path: Path) -> None:
    config = TraceConfig(num_adapters=4, duration=0.5, vocab_size=1024, adapter_prefix="s1-")
    trace_path = save_trace(generate_trace(config), tmp_path / "trace.jsonl")
    with pytest.raises(ValueError, match=r"--trace names adapters s1-\*, --setting Sall makes sall-\*"):
        pool_churn.main(["--trace", str(trace_path), "--work", str(tmp_path / "work"), "--setting", "Sall"])
