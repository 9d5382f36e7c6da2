"""perf/bench_host_step.py on the tiny model: the engine keeps decoding with the stubbed forward, and the timing
comes back for every repeat."""

from __future__ import annotations

import json
from pathlib import Path

from perf import bench_host_step


def test_host_step_times_decode_steps_with_adapters(tiny_model: Path, tiny_adapters: Path, tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    result = bench_host_step.main(["--model", str(tiny_model), "--adapter-root", str(tiny_adapters), "--adapters", "6",
                                   "--seqs", "12", "--prompt-len", "20", "--steps", "5", "--repeats", "3",
                                   "--out", str(out)])  # fmt: skip
    assert result.seqs == 12 and result.adapters == 6
    assert len(result.repeats_ms) == 3 and all(t > 0 for t in result.repeats_ms)
    slack = 0.001  # the repeats are reported rounded to 3 decimals, the median is not: one unit of slack
    assert min(result.repeats_ms) - slack <= result.median_ms <= max(result.repeats_ms) + slack
    assert json.loads(out.read_text())["median_ms"] == result.median_ms
