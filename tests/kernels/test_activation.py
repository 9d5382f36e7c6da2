"""Fused SiLU · up (kernels/triton/activation.py) against the torch reference (activation_ref.py): within an ulp of the
dtype (the kernel's sigmoid and torch's may round differently), mostly bit-equal, on a gate/up buffer with a
row stride wider than its columns; the input is left as it was."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from slora.kernels.reference.activation import silu_mul_ref  # noqa: E402
from slora.kernels.triton.activation import silu_mul  # noqa: E402
from tests.kernels.builders import DEVICE, gpu_only  # noqa: E402
from tests.kernels.test_norm_rope import DTYPES, assert_within_ulps  # noqa: E402

CPU_INTER = (24, 1536)
FULL_INTER = (1536, 11008, 14336)


def check_silu_mul(num_tokens: int, inter: int, dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    wide = (4 * torch.randn((num_tokens, 2 * inter + 8), generator=gen, device=DEVICE)).to(dtype)
    gate_up = wide[:, : 2 * inter]  # row stride 2·inter + 8
    before = gate_up.clone()
    expected = silu_mul_ref(gate_up.clone(), inter)

    out = silu_mul(gate_up, inter)

    assert out.is_contiguous() and out.shape == (num_tokens, inter) and out.dtype == dtype
    assert torch.equal(gate_up, before)
    # SiLU is rounded once, then the product: up to an ulp of SiLU's value carried into the product, plus its own.
    if not num_tokens:
        return
    scale = expected.abs() + gate_up[:, inter:].float().abs() * gate_up[:, :inter].float().abs()
    assert_within_ulps(out, expected, scale, ulps=2)
    if dtype != torch.float32:
        same = (out == expected).float().mean().item()
        assert same >= 0.95, f"only {same:.1%} of the outputs are bit-equal to the reference"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", CPU_INTER)
@pytest.mark.parametrize("num_tokens", (0, 1, 5))
def test_silu_mul(num_tokens: int, inter: int, dtype: torch.dtype) -> None:
    check_silu_mul(num_tokens, inter, dtype, seed=num_tokens + inter)


@gpu_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", FULL_INTER)
def test_silu_mul_full_shapes(inter: int, dtype: torch.dtype) -> None:
    check_silu_mul(300, inter, dtype, seed=inter)


@pytest.mark.parametrize(
    ("shape", "inter", "message"),
    [((4, 10), 4, r"gate_up must be \[num_tokens, 8\]"), ((8,), 4, r"gate_up must be \[num_tokens, 8\]")],
)
def test_silu_mul_rejects(shape: tuple[int, ...], inter: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        silu_mul(torch.zeros(shape, device=DEVICE), inter)
