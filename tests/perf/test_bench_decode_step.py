"""bench_decode_step: whole decode steps timed per batch size, with and without adapters (CPU smoke)."""

from __future__ import annotations

import argparse
from pathlib import Path

from perf.bench_decode_step import adapter_dirs, graph_modes, run


def test_times_every_batch_and_adapter_mix(tiny_model: Path, tiny_adapters: Path, tmp_path: Path) -> None:
    args = argparse.Namespace(
        model=str(tiny_model), load_format="dummy", adapter_root=str(tiny_adapters), device="cpu",
        kernel_backend="torch", pool_bytes=64 << 20, batch=[1, 3], steps=2, prompt_len=8, adapter_counts=[0, -1, 2],
        profile=tmp_path / "profile.txt", profile_steps=1, graphs_only=False,
    )  # fmt: skip
    timings = run(args)
    counts = [(t.batch, t.adapters) for t in timings]
    assert counts == [(1, 0), (1, 1), (1, 1), (3, 0), (3, 3), (3, 2)], "count -1: one adapter per request; k: k"
    assert all(t.step_ms > 0 and t.step_median_ms > 0 and t.weight_read_ms > 0 and t.ratio > 0 for t in timings)
    base, one, three = timings[3], timings[1], timings[4]
    assert base.adapter_bytes == 0 and three.adapter_bytes == 3 * one.adapter_bytes > 0
    assert three.kv_bytes == 3 * one.kv_bytes > 0 and base.weight_bytes == three.weight_bytes > 0
    assert three.bandwidth_gbs > 0
    profile = args.profile.read_text()
    assert profile.count("== torch.profiler") == profile.count("== cProfile") == 6, "each timing profiled once"
    assert "batch 3 graphs False adapters 2" in profile
    assert len(adapter_dirs(str(tiny_adapters), 3)) == 3
    assert not any(name.startswith(".") for name in adapter_dirs(str(tiny_adapters), 100))


def test_graph_modes() -> None:
    assert graph_modes("cuda", graphs_only=False) == (False, True)
    assert graph_modes("cuda", graphs_only=True) == (True,)
    assert graph_modes("cpu", graphs_only=True) == (False,), "no CUDA graphs on the CPU"
