"""The fused LoRA kernel (kernels/triton/lora_fused.py), a benchmark candidate, against the torch reference: every
token of decode, prompt and mixed steps gets its delta once, over the tiny shape's calls of one to three modules and
adapters of mixed ranks; y stays where no adapter applies."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from slora.kernels.reference.lora import lora_ref  # noqa: E402
from slora.kernels.triton.lora_call import consecutive_runs  # noqa: E402
from slora.kernels.triton.lora_fused import DEFAULT, fused_lora  # noqa: E402
from tests.kernels.builders import DEVICE, TINY, assert_close  # noqa: E402
from tests.kernels.test_lora import TINY_ADAPTERS, TINY_STEPS, build_case, layer_calls, untouched  # noqa: E402


@pytest.mark.parametrize("block_m", [1, 16])
@pytest.mark.parametrize("step", sorted(TINY_STEPS))
def test_fused_lora_matches_reference(step: str, block_m: int) -> None:
    case = build_case(TINY, torch.bfloat16, list(TINY_ADAPTERS), TINY_STEPS[step], seed=41)
    cfg = dataclasses.replace(DEFAULT, block_m=block_m, block_k=32, block_n=16)  # several steps of each loop
    gen = torch.Generator(device=DEVICE).manual_seed(42)
    for modules, offsets, widths, in_features in layer_calls(case.shape):
        x = torch.randn((case.num_tokens, in_features), generator=gen, device=DEVICE).to(torch.bfloat16)
        y0 = torch.randn((case.num_tokens, sum(widths)), generator=gen, device=DEVICE).to(torch.bfloat16)
        expected = y0.clone()
        lora_ref(expected, x, case.flat_layer, case.meta, modules, offsets, widths)
        actual = y0.clone()
        for first, run_offsets, run_widths in consecutive_runs(modules, offsets, widths):
            fused_lora(actual, x, case.flat_layer, case.meta, first, run_offsets, run_widths, cfg=cfg)
        magnitude = float((expected.float() - y0.float()).abs().max())
        assert magnitude > 0, f"modules {modules}: the step adds no LoRA delta (a broken test case)"
        assert_close(actual, expected, torch.bfloat16, magnitude)
        keep = untouched(case, modules, offsets, widths)
        assert torch.equal(actual[keep], y0[keep]), f"modules {modules}: y changed where no adapter applies"


def test_fused_steps_narrow_with_the_rank() -> None:
    """A loop step loads at most max_tile elements of A or Bᵀ: rank 8 keeps the configured steps, rank 128 narrows
    them, never below 16 columns."""
    cfg = dataclasses.replace(DEFAULT, block_k=512, block_n=256, max_tile=8192)
    assert cfg.steps(8) == (512, 256)
    assert cfg.steps(128) == (64, 64)
    assert cfg.steps(1024) == (16, 16)


def test_fused_lora_rejects_calls_it_cannot_run() -> None:
    case = build_case(TINY, torch.bfloat16, list(TINY_ADAPTERS), TINY_STEPS["decode"], seed=43)
    x = torch.zeros((case.num_tokens, TINY.hidden), device=DEVICE).to(torch.bfloat16)
    y = torch.zeros((case.num_tokens, 4 * TINY.hidden), device=DEVICE).to(torch.bfloat16)
    with pytest.raises(ValueError, match="1 to 3 modules"):
        fused_lora(y, x, case.flat_layer, case.meta, 0, (0, 1, 2, 3), (1, 1, 1, 1))
    with pytest.raises(ValueError, match="not LoRA modules"):
        fused_lora(y, x, case.flat_layer, case.meta, 6, (0, 8), (8, 8))
    with pytest.raises(ValueError, match="unit column stride"):
        fused_lora(y, x[:-1], case.flat_layer, case.meta, 0, (0,), (8,))
