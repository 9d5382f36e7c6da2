"""The fused LoRA kernel (kernels/triton/lora_fused.py), a benchmark candidate, against the torch reference: every
token of decode, prompt and mixed steps gets its delta once, over the tiny shape's calls of one to three modules and
adapters of mixed ranks; y stays where no adapter applies."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from slora.kernels.metadata import LoraMeta  # noqa: E402
from slora.kernels.triton.lora_call import consecutive_runs  # noqa: E402
from slora.kernels.triton.lora_fused import DEFAULT, fused_lora  # noqa: E402
from tests.kernels.builders import DEVICE, TINY  # noqa: E402
from tests.kernels.test_lora import TINY_ADAPTERS, TINY_STEPS, build_case, check_layer  # noqa: E402


@pytest.mark.parametrize("block_m", [1, 16])
@pytest.mark.parametrize("step", sorted(TINY_STEPS))
def test_fused_lora_matches_reference(step: str, block_m: int) -> None:
    case = build_case(TINY, torch.bfloat16, list(TINY_ADAPTERS), TINY_STEPS[step], seed=41)
    cfg = dataclasses.replace(DEFAULT, block_m=block_m, block_k=32, block_n=16)  # several steps of each loop

    def fused(y: torch.Tensor, x: torch.Tensor, flat_layer: torch.Tensor, meta: LoraMeta, modules: tuple[int, ...],
              offsets: tuple[int, ...], widths: tuple[int, ...]) -> None:  # fmt: skip
        for first, run_offsets, run_widths in consecutive_runs(modules, offsets, widths):
            fused_lora(y, x, flat_layer, meta, first, run_offsets, run_widths, cfg=cfg)

    check_layer(case, fused, seed=42)


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
    with pytest.raises(ValueError, match="1 to 3 fused modules"):
        fused_lora(y, x, case.flat_layer, case.meta, 0, (0, 1, 2, 3), (1, 1, 1, 1))
    with pytest.raises(ValueError, match="not LoRA modules"):
        fused_lora(y, x, case.flat_layer, case.meta, 6, (0, 8), (8, 8))
    with pytest.raises(ValueError, match="unit column stride"):
        fused_lora(y, x[:-1], case.flat_layer, case.meta, 0, (0,), (8,))
