"""perf.trace_steps ties device operations to the step that launched them and splits each step's device span into
busy and idle time; checked on a hand-written chrome trace whose numbers are worked out below."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from perf.trace_steps import load_trace, main, step_timelines, summary, union_ms


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


def test_steps_own_the_operations_they_launched() -> None:
    eager, graph = step_timelines(_trace())
    assert (eager.kind, graph.kind) == ("eager", "graph")
    assert eager.host_ms == pytest.approx(0.100) and graph.host_ms == pytest.approx(0.050)
    assert eager.launches == 3 and graph.launches == 1
    assert eager.span_ms == pytest.approx(0.070)  # 20-90 on stream 7, the busiest
    assert eager.busy_ms == pytest.approx(0.050) and eager.idle_ms == pytest.approx(0.020)
    assert eager.other_streams_ms == pytest.approx(0.040)
    assert eager.kernels_ms == pytest.approx({"a": 0.030, "b": 0.020})
    assert graph.span_ms == pytest.approx(0.060) and graph.idle_ms == pytest.approx(0.0)


def test_summary_and_command_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    text = summary(step_timelines(_trace()))
    assert "| 0 | eager | 0.10 | 0.07 | 0.05 | 0.02 | 0.04 | 3 |" in text
    assert "graph steps (1): mean host 0.05 ms, device span 0.06, busy 0.06, idle 0.00 ms" in text
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(), f)
    assert load_trace(path) == _trace()
    with caplog.at_level("INFO"):
        main([str(path)])
    assert "eager steps (1)" in caplog.text
