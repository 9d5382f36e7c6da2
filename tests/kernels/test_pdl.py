"""Programmatic dependent launch of the LoRA expand kernel (kernels/pdl.py): when it is on, and that the LoRA
calls launched with it still match the torch reference on the GPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("triton")

from slora.kernels import jit_stats, lora_expand, pdl  # noqa: E402
from tests.kernels.builders import DEVICE, FULL_SHAPES, gpu_only  # noqa: E402
from tests.kernels.test_lora import build_case, check_layer, gpu_adapters, gpu_step  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_answer() -> Iterator[None]:
    pdl.pdl_enabled.cache_clear()
    yield
    pdl.pdl_enabled.cache_clear()


def test_off_on_the_cpu() -> None:
    assert not pdl.pdl_enabled(torch.device("cpu"))


def test_turned_off_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pdl.ENV, "0")
    assert not pdl.pdl_enabled(DEVICE)


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def launched_with_pdl() -> set[bool]:
    """launch_pdl of every compiled variant of the decode expand kernel so far."""
    return {bool(c.metadata.launch_pdl) for c in jit_stats.compiled_kernels(lora_expand._lora_expand_gemv_kernel)}


@gpu_only
@pytest.mark.parametrize("use_pdl", [True, False], ids=["pdl", "no-pdl"])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_lora_layer_matches_reference(kind: str, use_pdl: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if use_pdl and not hopper():
        pytest.skip("PDL needs compute capability 9 or later")
    monkeypatch.setenv(pdl.ENV, "1" if use_pdl else "0")
    assert pdl.pdl_enabled(DEVICE) == use_pdl
    shape = FULL_SHAPES[2]
    case = build_case(shape, torch.bfloat16, gpu_adapters(64), gpu_step(kind, 64), seed=21)
    check_layer(case, "triton", seed=22)
    if kind == "decode":
        assert use_pdl in launched_with_pdl()
