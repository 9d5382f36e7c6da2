"""Programmatic dependent launch of the LoRA kernels (kernels/triton/pdl.py): when it is on, and that the LoRA calls
launched with it still match the torch reference on the GPU, also right behind the base projection they add into.
The settings (EngineConfig's lora_pdl and shrink_pdl) turn it off."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("triton")

from slora.kernels.reference.lora import lora_ref  # noqa: E402
from slora.kernels.settings import KernelSettings  # noqa: E402
from slora.kernels.triton import jit_stats, lora_expand, lora_fused, lora_shrink, pdl  # noqa: E402
from slora.kernels.triton import ops as triton_ops
from slora.kernels.triton.ops import TritonOps  # noqa: E402
from slora.kernels.triton.projection import MAX_ROWS, Projections  # noqa: E402
from tests.kernels.builders import DEVICE, FULL_SHAPES, TINY, assert_close, gpu_only  # noqa: E402
from tests.kernels.test_lora import build_case, check_layer, gpu_adapters, gpu_step, layer_calls  # noqa: E402
from tests.kernels.test_projection import always_triton  # noqa: E402

SETTINGS = KernelSettings()


@pytest.fixture(autouse=True)
def fresh_answer() -> Iterator[None]:
    pdl.device_supports_pdl.cache_clear()
    yield
    pdl.device_supports_pdl.cache_clear()


def test_off_on_the_cpu() -> None:
    assert not pdl.pdl_enabled(torch.device("cpu"), SETTINGS)


def test_turned_off_through_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pdl, "device_supports_pdl", lambda device: True)  # a Hopper GPU, as far as pdl.py can tell
    assert pdl.pdl_enabled(DEVICE, SETTINGS) and pdl.shrink_pdl(DEVICE, SETTINGS), "on by default where supported"
    off = KernelSettings(lora_pdl=False)
    assert not pdl.pdl_enabled(DEVICE, off)
    assert not pdl.shrink_pdl(DEVICE, off), "the shrink's PDL goes with the rest"


def test_shrink_turned_off_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pdl, "device_supports_pdl", lambda device: True)
    shrink_off = KernelSettings(shrink_pdl=False)
    assert not pdl.shrink_pdl(DEVICE, shrink_off)
    assert pdl.pdl_enabled(DEVICE, shrink_off), "the expand keeps it"


def test_the_environment_no_longer_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """SLORA_LORA_PDL / SLORA_SHRINK_PDL are retired: set, they change nothing (the engine warns, startup.py)."""
    monkeypatch.setattr(pdl, "device_supports_pdl", lambda device: True)
    monkeypatch.setenv("SLORA_LORA_PDL", "0")
    monkeypatch.setenv("SLORA_SHRINK_PDL", "0")
    assert pdl.pdl_enabled(DEVICE, SETTINGS) and pdl.shrink_pdl(DEVICE, SETTINGS)


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def launched_with_pdl(kernel: object = lora_expand._lora_expand_gemv_kernel) -> set[bool]:
    """launch_pdl of every compiled variant of `kernel` (default: the decode expand) so far."""
    return {bool(c.metadata.launch_pdl) for c in jit_stats.compiled_kernels(kernel)}


@gpu_only
@pytest.mark.parametrize("use_pdl", [True, False], ids=["pdl", "no-pdl"])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_lora_layer_matches_reference(kind: str, use_pdl: bool) -> None:
    if use_pdl and not hopper():
        pytest.skip("PDL needs compute capability 9 or later")
    settings = KernelSettings(lora_pdl=use_pdl)
    assert pdl.pdl_enabled(DEVICE, settings) == use_pdl
    shape = FULL_SHAPES[2]
    case = build_case(shape, torch.bfloat16, gpu_adapters(64), gpu_step(kind, 64), seed=21)
    check_layer(case, "triton", seed=22, settings=settings)
    if kind == "decode":
        assert use_pdl in launched_with_pdl()


@gpu_only
@pytest.mark.parametrize("fused", [False, True], ids=["pair", "fused"])
@pytest.mark.parametrize("use_pdl", [True, False], ids=["pdl", "no-pdl"])
@pytest.mark.parametrize("decodes", [16, 64, 65], ids=["triton-gemm-16", "triton-gemm-64", "cublas"])
def test_lora_right_behind_its_projection(decodes: int, use_pdl: bool, fused: bool) -> None:
    """The engine's order, x from a norm, y = x·Wᵀ, then the LoRA into y, launched back to back for several inputs
    before one sync: launched with PDL, the shrink must not read x before the norm has written it nor let the
    expand read y before the GEMM has written it (on the Triton GEMM of small
    steps, which lets the shrink start early; behind cuBLAS the shrink is launched without PDL). fused: the fused
    kernel (lora_fused, ranks up to its MAX_RANK) in place of the shrink and expand, under the same rules."""
    if use_pdl and not hopper():
        pytest.skip("PDL needs compute capability 9 or later")
    shape = FULL_SHAPES[2]
    step: list[tuple[int | None, int]] = [(i % 4, 1) for i in range(decodes)]
    ranks = [(4 if fused else 64,) * 7, (16,) * 7, (8,) * 7, (1,) * 7]
    case = build_case(shape, torch.bfloat16, ranks, step, seed=31)
    gen = torch.Generator(device=DEVICE).manual_seed(32)
    ops = TritonOps(KernelSettings(triton_gemm=True, shrink_pdl=use_pdl, lora_fused=fused))
    for modules, offsets, widths, in_features in layer_calls(shape):
        weight = torch.randn((sum(widths), in_features), generator=gen, device=DEVICE).to(torch.bfloat16) / 64
        norm_weight = torch.rand(in_features, generator=gen, device=DEVICE).to(torch.bfloat16) + 0.5
        states = [torch.randn((decodes, in_features), generator=gen, device=DEVICE).bfloat16() for _ in range(8)]
        outs = []
        for h in states:  # no sync in between: norm, GEMM, shrink and expand follow one another directly
            x, _ = ops.rms_norm(h, norm_weight, 1e-5)
            y = ops.linear(x, weight)
            ops.lora(y, x, case.flat_layer, case.meta, modules, offsets, widths)
            outs.append((x, y))
        for h, (x, actual) in zip(states, outs):
            assert torch.equal(x, ops.rms_norm(h, norm_weight, 1e-5)[0])
            expected = torch.nn.functional.linear(x.float(), weight.float()).to(torch.bfloat16)
            lora_ref(expected, x, case.flat_layer, case.meta, modules, offsets, widths)
            assert_close(actual, expected, torch.bfloat16, float(expected.float().abs().max()))
    behind_triton = decodes <= MAX_ROWS
    assert behind_triton == bool(ops.projections._launches), "steps of up to MAX_ROWS rows on the Triton GEMM"
    first = lora_fused._lora_fused_kernel if fused else lora_shrink._lora_shrink_gemv_kernel
    assert (use_pdl and behind_triton) in launched_with_pdl(first)


def test_only_a_shrink_behind_the_triton_gemm_asks_for_pdl(monkeypatch: pytest.MonkeyPatch) -> None:
    """TritonOps builds a call site's launches with pdl_shrink only when the Triton GEMM wrote the y at hand (on CPU:
    the interpreter, Projections' size checks bypassed); behind cuBLAS, or behind another projection, it does not."""
    asked: list[bool] = []

    def recording(*args: object, pdl_shrink: bool = False) -> list[object]:
        asked.append(pdl_shrink)
        return real(*args, pdl_shrink=pdl_shrink)

    real = triton_ops.lora_calls
    monkeypatch.setattr(triton_ops, "lora_calls", recording)
    case = build_case(TINY, torch.float32, [(8,) * 7, (4,) * 7], [(0, 1), (1, 1), (None, 1)], seed=41)
    modules, offsets, widths, in_features = layer_calls(TINY)[0]
    gen = torch.Generator(device=DEVICE).manual_seed(42)
    x = torch.randn((case.num_tokens, in_features), generator=gen, device=DEVICE)
    weight = torch.randn((sum(widths), in_features), generator=gen, device=DEVICE)
    ops = TritonOps()
    on_cublas = ops.linear(x, weight)
    ops.lora(on_cublas, x, case.flat_layer, case.meta, modules, offsets, widths)
    monkeypatch.setattr(Projections, "takes_triton", always_triton)
    first = ops.linear(x, weight)
    ops.lora(first, x, case.flat_layer, case.meta, modules, offsets, widths)
    ops.linear(x, weight)
    ops.lora(first, x, case.flat_layer, case.meta, modules, offsets, widths)  # not the last projection's output
    assert asked == [False, True], "one build per (y's origin, shape); the third call reused the first's launches"
