"""Which projections take the Triton GEMM (kernels/triton/projection.py), and that they compute F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slora.kernels.settings import KernelSettings
from slora.kernels.triton.projection import MAX_ROWS, Projections
from tests.kernels.builders import DEVICE, assert_close, gpu_only


def test_cpu_projections_are_f_linear() -> None:
    proj = Projections(KernelSettings(triton_gemm=True))
    x, w = torch.randn(4, 2048), torch.randn(2048, 2048)
    assert torch.equal(proj(x, w), F.linear(x, w))
    assert not proj.takes_triton(x.bfloat16(), w.bfloat16(), None), "CPU tensors stay on F.linear"


def always_triton(self: Projections, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return True


def test_the_last_triton_output_is_known(monkeypatch: pytest.MonkeyPatch) -> None:
    """wrote_last(y): y is the last projection's output and the Triton GEMM wrote it (on CPU: the interpreter, the
    size checks bypassed), so that TritonOps may launch the LoRA shrink behind it with PDL; out= writes in place."""
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    x, w = torch.randn(3, 32, generator=gen, device=DEVICE), torch.randn(48, 32, generator=gen, device=DEVICE)
    proj = Projections(KernelSettings(triton_gemm=True))
    on_cublas = proj(x, w)
    assert not proj.wrote_last(on_cublas), "F.linear's output"
    monkeypatch.setattr(Projections, "takes_triton", always_triton)
    first = proj(x, w)
    assert proj.wrote_last(first)
    out = torch.empty(3, 48, device=DEVICE)
    assert proj(x, w, out=out) is out and proj.wrote_last(out) and not proj.wrote_last(first)
    assert_close(out, F.linear(x, w), torch.float32, float(out.abs().max()))
    monkeypatch.undo()
    assert proj(x, w, out=out) is out and not proj.wrote_last(out), "cuBLAS into out"
    assert torch.allclose(out, F.linear(x, w))
    with pytest.raises(ValueError, match="out must be"):
        proj(x, w, out=torch.empty(3, 47, device=DEVICE))


def test_settings_turn_the_triton_gemm_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not Projections(KernelSettings(triton_gemm=False)).triton_gemm
    assert Projections(KernelSettings()).triton_gemm
    monkeypatch.setenv("SLORA_TRITON_GEMM", "0")  # retired: the settings alone decide
    assert Projections(KernelSettings()).triton_gemm


@gpu_only
def test_off_the_triton_gemm_takes_nothing() -> None:
    proj = Projections(KernelSettings(triton_gemm=False))
    w = torch.randn(4096, 2048, device=DEVICE, dtype=torch.bfloat16)
    assert not proj.takes_triton(torch.zeros(4, 2048, device=DEVICE, dtype=torch.bfloat16), w, None)


@gpu_only
def test_small_steps_of_wide_weights_take_the_triton_gemm() -> None:
    proj = Projections(KernelSettings(triton_gemm=True))
    w = torch.randn(4096, 2048, device=DEVICE, dtype=torch.bfloat16)
    taken = {
        m: proj.takes_triton(torch.zeros(m, 2048, device=DEVICE, dtype=torch.bfloat16), w, None)
        for m in (1, 16, 17, MAX_ROWS, MAX_ROWS + 1)
    }
    assert taken == {1: True, 16: True, 17: True, MAX_ROWS: True, MAX_ROWS + 1: False}
    narrow = torch.zeros(576, 576, device=DEVICE, dtype=torch.bfloat16)
    assert not proj.takes_triton(torch.zeros(4, 576, device=DEVICE, dtype=torch.bfloat16), narrow, None)
    assert not proj.takes_triton(torch.zeros(4, 2048, device=DEVICE), w.float(), None), "float32 stays on cuBLAS"


@gpu_only
@pytest.mark.parametrize("rows", [1, 7, 16, 24, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_projections_match_f_linear(rows: int, dtype: torch.dtype) -> None:
    """Two layers' weights of one shape (one launch, reused) and a bias, against F.linear."""
    gen = torch.Generator(device=DEVICE).manual_seed(rows)
    proj = Projections(KernelSettings(triton_gemm=True))
    for _ in range(2):
        x = torch.randn(rows, 4096, generator=gen, device=DEVICE).to(dtype)
        w = (torch.randn(6144, 4096, generator=gen, device=DEVICE) * 0.02).to(dtype)
        b = torch.randn(6144, generator=gen, device=DEVICE).to(dtype)
        for bias in (None, b):
            expected = F.linear(x, w, bias)
            assert_close(proj(x, w, bias), expected, dtype, float(expected.float().abs().max()))
    assert len(proj._launches) == 2, "one launch per shape and bias, reused by the second layer"
