"""The fused LoRA kernel (kernels/triton/lora_fused.py) against the torch reference: every token of decode, prompt
and mixed steps gets its delta once, over the tiny shape's calls of one to three modules and adapters of mixed
ranks; y stays where no adapter applies. With KernelSettings.lora_fused the engine's calls launch it for decodes of
many adapters of small ranks, and the launch pair for the rest."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from slora.backend.config import EngineConfig  # noqa: E402
from slora.kernels.metadata import LoraMeta  # noqa: E402
from slora.kernels.settings import KernelSettings  # noqa: E402
from slora.kernels.triton import lora_call  # noqa: E402
from slora.kernels.triton.lora_call import consecutive_runs  # noqa: E402
from slora.kernels.triton.lora_fused import DEFAULT, MAX_RANK, fused_lora  # noqa: E402
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


SMALL = [a for a in TINY_ADAPTERS if max(a) <= MAX_RANK]  # ranks the engine launches the fused kernel for
FUSED = KernelSettings(lora_fused=True)


def record_launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(kernel, the group's longest segment) of every fused launch and launch pair the engine's calls build."""
    launches: list[tuple[str, int]] = []
    fused, shrink = lora_call.fused_launch, lora_call.shrink_launch
    monkeypatch.setattr(lora_call, "fused_launch", lambda *a, **kw: launches.append(("fused", a[7].max_segment_len))
                        or fused(*a, **kw))  # fmt: skip
    monkeypatch.setattr(lora_call, "shrink_launch", lambda *a, **kw: launches.append(("pair", a[5].max_segment_len))
                        or shrink(*a, **kw))  # fmt: skip
    return launches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_engine_launches_the_fused_kernel_for_decodes(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """lora_fused (off by default): a decode step of many adapters is one fused launch per call; a step with prompts
    launches its decodes fused and its prompts on the pair; both match the reference."""
    assert not EngineConfig().kernel_settings().lora_fused
    assert EngineConfig.from_dict({"lora_fused": "true"}).kernel_settings().lora_fused
    launches = record_launches(monkeypatch)
    decode = [(0, 1), (None, 1), (1, 1), (2, 1), (1, 1), (3, 1), (None, 1), (0, 1)]
    check_layer(build_case(TINY, dtype, SMALL, decode, seed=5), "triton", 6, FUSED)
    assert launches == [("fused", 2)] * 4, launches  # q/k/v, o, gate/up, down (adapters 0 and 1: 2 tokens)
    launches.clear()
    mixed = [(2, 20), (0, 1), (None, 3), (3, 1), (1, 17)]
    check_layer(build_case(TINY, dtype, SMALL, mixed, seed=7), "triton", 8, FUSED)
    assert launches == [("fused", 1), ("pair", 20)] * 4, launches


def test_engine_keeps_the_pair_beyond_the_fused_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step with an adapter of rank above MAX_RANK, and decodes of few adapters (the tensor-core tiles),
    keep the launch pair under lora_fused."""
    launches = record_launches(monkeypatch)
    check_layer(build_case(TINY, torch.float32, list(TINY_ADAPTERS), TINY_STEPS["decode"], seed=9), "triton", 10,
                FUSED)  # fmt: skip
    assert launches and {kind for kind, _ in launches} == {"pair"}, launches
    launches.clear()
    few = KernelSettings(lora_fused=True, few_adapters_min_tokens=4, few_adapters_max=2)
    check_layer(build_case(TINY, torch.float32, SMALL, [(1, 1)] * 3 + [(2, 1)] * 3, seed=11), "triton", 12, few)
    assert launches and {kind for kind, _ in launches} == {"pair"}, launches
