"""bench_adapter_copy on CPU (smoke: one call each way): both ways run and place the image, and the JSON holds
one row per adapter size."""

from __future__ import annotations

import json
from pathlib import Path

from perf.bench_adapter_copy import main


def test_smoke_run_writes_one_row_per_adapter_size(tmp_path: Path) -> None:
    out = tmp_path / "copy.json"
    assert (
        main(["--out", str(out), "--layers", "2", "--pages", "8", "--adapter-pages", "1", "3", "--device", "cpu"]) == 0
    )
    rows = json.loads(out.read_text())
    assert [row["pages_per_layer"] for row in rows] == [1, 3]
    assert all(row["whole_pool_ms"] > 0 and row["by_layer_ms"] > 0 for row in rows)
