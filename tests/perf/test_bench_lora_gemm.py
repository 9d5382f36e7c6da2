"""bench_lora_gemm on the CPU (Triton interpreter, tiny shapes): its paths compute the same layer, and the configs it
picks for part 2 are part 1's fastest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perf import bench_lora_gemm
from perf.bench_lora_gemm import best_configs
from slora.kernels.lora_gemm import GemmConfig


def test_smoke_run_agrees_with_the_engine_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "lora_gemm.json"
    assert bench_lora_gemm.main(["--smoke", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert {e["impl"] for e in payload["gemm"]} == {"cublas", repr(bench_lora_gemm.SMOKE_CONFIGS[0])}
    (layer,) = payload["layer"]
    assert set(layer["ms"]) == {"cublas", "cublas+lora", "triton", "fused"}
    assert layer["lora_min_bytes"] > 0
    assert layer["fused_rel_err"] < 2e-2, "the fused path's y differs from cuBLAS + the LoRA launches'"


def test_best_configs_are_the_fastest_per_projection(monkeypatch: pytest.MonkeyPatch) -> None:
    slow, fast = GemmConfig(16, 32, 32, 4, 2), GemmConfig(16, 64, 32, 4, 2)
    monkeypatch.setattr(bench_lora_gemm, "CONFIGS", [slow, fast])
    sweep = [
        {"projection": "qkv", "m": 16, "impl": repr(slow), "ms": 2.0},
        {"projection": "qkv", "m": 16, "impl": repr(fast), "ms": 1.0},
        {"projection": "qkv", "m": 16, "impl": "cublas", "ms": 0.5},
        {"projection": "o", "m": 16, "impl": repr(fast), "ms": None},
        {"projection": "o", "m": 16, "impl": repr(slow), "ms": 3.0},
        {"projection": "o", "m": 64, "impl": repr(fast), "ms": 0.1},
    ]
    assert best_configs(sweep, 16) == {"qkv": fast, "o": slow}
