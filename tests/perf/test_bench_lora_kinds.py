"""bench_lora_kinds: its switch between the GEMV and the tensor-core decode kernels, and its cases (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from perf import bench_kernels
from perf.bench_kernels import TINY_MHA, adapters, lora_case
from perf.bench_lora_kinds import cases, decode_kernels, layer_fns, projection_weights
from slora.kernels.metadata import SegmentGroup
from slora.kernels.reference.lora import lora_ref
from slora.kernels.triton import lora_expand, lora_shrink


def test_decode_kernels_switches_and_restores() -> None:
    group = SegmentGroup([(0, 0, 1, 0), (1, 1, 2, 1)], device=None)  # type: ignore[arg-type]
    assert lora_shrink.shrink_config(group, 3).gemv and lora_expand.expand_config(group, 1).gemv
    with decode_kernels("tensor"):
        assert lora_shrink.shrink_config(group, 3) == lora_shrink.MIXED
        assert lora_expand.expand_config(group, 1) == lora_expand.MIXED
    assert lora_shrink.shrink_config(group, 3).block_m == lora_expand.expand_config(group, 1).block_m == 1
    with decode_kernels("gemv4"):
        assert lora_shrink.shrink_config(group, 3).block_m == lora_expand.expand_config(group, 1).block_m == 4
        assert lora_shrink.shrink_config(group, 3).gemv
    assert lora_shrink.shrink_config(group, 1) == lora_shrink.DECODE_ONE, "restored after the block"
    with pytest.raises(RuntimeError), decode_kernels("tensor"):
        raise RuntimeError("a failing case")
    assert lora_expand.expand_config(group, 3) == lora_expand.DECODE, "restored after an error too"


def test_cases_spread_few_adapters_and_one_per_request() -> None:
    assert [len(ranks) for _, ranks in cases(16)] == [1, 4, 5, 5, 24, 16]
    named = cases(96)
    assert [len(ranks) for _, ranks in named] == [24, 96], "more than 16 tokens an adapter: prompt tiles, left out"
    assert all(name.startswith("96 decodes") for name, _ in named)


def test_decode_kernels_sets_shrink_and_expand_tiles_apart() -> None:
    group = SegmentGroup([(0, 0, 1, 0)], device=None)  # type: ignore[arg-type]
    with decode_kernels("shrink1_expand4"):
        assert lora_shrink.shrink_config(group, 1).block_m == 1
        assert lora_expand.expand_config(group, 1).block_m == lora_expand.expand_config(group, 3).block_m == 4


def test_behind_gemm_layer_adds_the_lora_to_the_projection(monkeypatch: pytest.MonkeyPatch) -> None:
    """--behind-gemm's layer: each call's y is x·Wᵀ from the engine's projections plus the LoRA delta (CPU: cuBLAS's
    stand-in and the interpreter), and its base runs the projections alone."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(bench_kernels, "DEVICE", torch.device("cpu"))
    case = lora_case("tiny", TINY_MHA, adapters([8, 16]), [(0, 1), (1, 1), (None, 1)])
    weights = projection_weights(TINY_MHA)
    fns = layer_fns(case, weights)
    fns.base()
    for y, x, modules, *_ in fns.calls:
        assert torch.equal(y, F.linear(x, weights[modules])), "base: the projection alone"
    fns.layer()
    for y, x, modules, offsets, widths in fns.calls:
        expected = F.linear(x, weights[modules])
        lora_ref(expected, x, case.flat_layer, case.meta, modules, offsets, widths)
        assert not torch.equal(expected, F.linear(x, weights[modules])), "the case adds no LoRA delta"
        assert torch.allclose(y.float(), expected.float(), atol=2e-2, rtol=2e-2)
