"""The Triton GEMM of decode projections (kernels/triton/gemm.py) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from slora.kernels.settings import KernelSettings  # noqa: E402
from slora.kernels.triton import gemm, pdl  # noqa: E402
from slora.kernels.triton.gemm import GemmConfig, column_block, gemm_launch  # noqa: E402
from tests.kernels.builders import DEVICE, assert_close  # noqa: E402

SMALL = GemmConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PDL = pdl.shrink_pdl(DEVICE, KernelSettings())  # the variant the engine's projections launch on this device


def random_linear(
    m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn((m, k), generator=gen, device=DEVICE).to(dtype)
    weight = torch.randn((n, k), generator=gen, device=DEVICE).to(dtype)
    b = torch.randn(n, generator=gen, device=DEVICE).to(dtype) if bias else None
    return x, weight, b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 5, 37])
def test_gemm_matches_linear(dtype: torch.dtype, bias: bool, m: int) -> None:
    x, weight, b = random_linear(m, 160, 96, dtype, bias, seed=m)
    y = torch.empty((m, 160), dtype=dtype, device=DEVICE)
    launch = gemm_launch(x, weight, y, b, cfg=SMALL, pdl=PDL)
    if b is None:
        launch(x, weight, y)
    else:
        launch(x, weight, y, b)
    expected = F.linear(x, weight, b)
    assert_close(y, expected, dtype, float(expected.float().abs().max()))


def test_one_launch_serves_every_layer() -> None:
    """The launch built for one layer's tensors computes the next layer's from theirs (its config picked for the
    rows: every token in one row block, every column block of the three modules)."""
    cfg = gemm.gemm_config(72, 96, 64)
    assert cfg.block_m == 128
    launch = None
    for layer in range(2):
        x, weight, _ = random_linear(72, 96, 64, torch.bfloat16, False, seed=20 + layer)
        y = torch.empty((72, 96), dtype=torch.bfloat16, device=DEVICE)
        launch = launch or gemm_launch(x, weight, y, cfg=cfg, widths=(64, 16, 16), pdl=PDL)
        launch(x, weight, y)
        expected = F.linear(x, weight)
        assert_close(y, expected, torch.bfloat16, float(expected.float().abs().max()))


def test_column_blocks_stay_inside_a_module() -> None:
    assert column_block(64, (4096, 1024, 1024)) == 64
    assert column_block(128, (576, 192, 192)) == 64
    assert column_block(64, (96, 32, 32)) == 32


def test_bad_inputs_are_named() -> None:
    x = torch.zeros((4, 64), device=DEVICE)
    with pytest.raises(ValueError, match="are not"):
        gemm_launch(x, torch.zeros((32, 48), device=DEVICE), torch.zeros((4, 32), device=DEVICE))
    with pytest.raises(ValueError, match="multiples of 16"):
        gemm_launch(x, torch.zeros((40, 64), device=DEVICE), torch.zeros((4, 40), device=DEVICE), widths=(24, 16))
    with pytest.raises(ValueError, match="y must be"):
        gemm_launch(x, torch.zeros((32, 64), device=DEVICE), torch.zeros((4, 31), device=DEVICE))
    with pytest.raises(ValueError, match="bias must be"):
        gemm_launch(x, torch.zeros((32, 64), device=DEVICE), torch.zeros((4, 32), device=DEVICE), torch.zeros(31))
