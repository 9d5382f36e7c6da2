"""bench_lora_gemm on the CPU (Triton interpreter, tiny shapes): its paths compute the same layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perf import bench_lora_gemm


def test_smoke_run_agrees_with_the_engine_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "lora_gemm.json"
    assert bench_lora_gemm.main(["--smoke", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["gemm"] == [], "part 1 runs with --sweep only"
    (layer,) = payload["layer"]
    assert set(layer["ms"]) == {"cublas", "cublas+lora", "triton", "triton+lora"}
    assert layer["lora_min_bytes"] > 0
    assert layer["triton_lora_rel_err"] < 2e-2, "the Triton GEMM + LoRA launches' y differs from cuBLAS + the same"
