"""perf.trace_steps ties device operations to the step that launched them and splits each step's device span into
busy and idle time; checked on a hand-written chrome trace whose numbers are worked out below."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from perf.trace_steps import busy_shares, load_trace, main, step_timelines, summary, union_ms


def _x(name: str, cat: str, ts: float, dur: float, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": 0, "args": args}


def _trace() -> dict[str, Any]:
    """Step 0 (eager, host 0-100 µs) launches kernels a (correlation 1) and b (2) on stream 7 and a copy (3) on
    stream 9; step 1 (host 100-150 µs) launches a CUDA graph (4) whose kernel runs on stream 7. A kernel launched
    outside any step (5) belongs to none."""
    return {"traceEvents": [
        _x("slora_step", "user_annotation", 0, 100),
        _x("slora_step", "gpu_user_annotation", 10, 500),  # the device-side copy of the range: not a step
        _x("slora_step", "user_annotation", 100, 50),
        _x("cuLaunchKernelEx", "cuda_driver", 10, 5, correlation=1),
        _x("cuLaunchKernelEx", "cuda_driver", 60, 5, correlation=2),
        _x("cudaMemcpyAsync", "cuda_runtime", 70, 5, correlation=3),
        _x("cudaGraphLaunch", "cuda_runtime", 110, 5, correlation=4),
        _x("cudaLaunchKernel", "cuda_runtime", 170, 5, correlation=5),
        _x("a", "kernel", 20, 30, correlation=1, stream=7),  # 20-50
        _x("b", "kernel", 70, 20, correlation=2, stream=7),  # 70-90: 20 µs idle between a and b
        _x("copy", "gpu_memcpy", 75, 40, correlation=3, stream=9),
        _x("g", "kernel", 120, 60, correlation=4, stream=7),
        _x("stray", "kernel", 180, 10, correlation=5, stream=7),
        {"ph": "i", "name": "marker", "ts": 5},
    ]}  # fmt: skip


def test_union_merges_overlapping_intervals() -> None:
    assert union_ms([(0, 10), (5, 20), (30, 40)]) == pytest.approx(0.030)
    assert union_ms([(0, 50), (10, 20)]) == pytest.approx(0.050)
    assert union_ms([]) == 0.0


def test_busy_shares_count_overlapping_kernels_once() -> None:
    # shrink 10-40 µs; expand launched with PDL at 15, waiting for the shrink, done at 60; then o 60-70, and k 62-65
    # inside o. Durations sum to 30 + 45 + 10 + 3 = 88 µs; the busy union is 10-70, 60 µs.
    ops = [("expand", 15.0, 60.0), ("shrink", 10.0, 40.0), ("o", 60.0, 70.0), ("k", 62.0, 65.0)]
    shares = busy_shares(ops)
    assert shares == pytest.approx({"shrink": 0.030, "expand": 0.020, "o": 0.010, "k": 0.0})
    assert sum(shares.values()) == pytest.approx(union_ms([(a, b) for _, a, b in ops]))
    assert busy_shares([("a", 0.0, 5.0), ("a", 10.0, 15.0)]) == pytest.approx({"a": 0.010})


def test_steps_own_the_operations_they_launched() -> None:
    eager, graph = step_timelines(_trace())
    assert (eager.kind, graph.kind) == ("eager", "graph")
    assert eager.host_ms == pytest.approx(0.100) and graph.host_ms == pytest.approx(0.050)
    assert eager.launches == 3 and graph.launches == 1
    assert eager.span_ms == pytest.approx(0.070)  # 20-90 on stream 7, the busiest
    assert eager.busy_ms == pytest.approx(0.050) and eager.idle_ms == pytest.approx(0.020)
    assert eager.other_streams_ms == pytest.approx(0.040)
    assert eager.kernels_ms == pytest.approx({"a": 0.030, "b": 0.020})
    assert eager.kernels_busy_ms == pytest.approx(eager.kernels_ms)  # no overlap in this step
    assert graph.span_ms == pytest.approx(0.060) and graph.idle_ms == pytest.approx(0.0)


def test_summary_and_command_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    text = summary(step_timelines(_trace()))
    assert "| 0 | eager | 0.10 | 0.07 | 0.05 | 0.02 | 0.04 | 3 |" in text
    assert "graph steps (1): mean host 0.05 ms, device span 0.06, busy 0.06, idle 0.00 ms" in text
    assert "0.060 ms a step busy (0.060 running)  g" in text
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(), f)
    assert load_trace(path) == _trace()
    with caplog.at_level("INFO"):
        main([str(path)])
    assert "eager steps (1)" in caplog.text
