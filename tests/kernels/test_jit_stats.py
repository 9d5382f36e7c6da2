"""The compile counter the benchmarks record: it reads Triton's per-device kernel caches, whatever their tuple."""

from __future__ import annotations

import types

from slora.kernels import jit_stats


def test_counts_every_cached_variant_across_devices() -> None:
    kernel = types.SimpleNamespace(device_caches={0: ({"k1": 1, "k2": 2}, {}, "t", "b", "bind"), 1: ({"k3": 3},)})
    assert jit_stats._count(kernel) == 3


def test_unknown_layouts_and_interpreted_kernels_count_zero() -> None:
    assert jit_stats._count(types.SimpleNamespace()) == 0
    assert jit_stats._count(types.SimpleNamespace(device_caches={0: "not a tuple"})) == 0


def test_every_project_kernel_is_listed() -> None:
    counts = jit_stats.compiled_variants()
    assert set(counts) == set(jit_stats.KERNELS.values())
    assert all(n >= 0 for n in counts.values())
