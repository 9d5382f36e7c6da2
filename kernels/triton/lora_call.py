"""The LoRA launches of one call site (q/k/v, o, gate/up or down) for one step, built once and reused by every layer.

Every layer of a step calls the same LoRA modules with the same metadata and tensor shapes; only x, y and the pool
layer change. A LoraCall holds the shrink and expand launches of one run of fused modules, for every segment of
the step, together with their partial-sum buffer v, so that a layer's call costs two direct
kernel launches (kernels/triton/relaunch.py) instead of re-deriving tiles, grids and buffers. With
KernelSettings.lora_fused, a group of decodes of many adapters gets a FusedCall instead: one launch of the fused
kernel (kernels/triton/lora_fused.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from slora.kernels.metadata import LoraMeta
from slora.kernels.settings import KernelSettings
from slora.kernels.triton.lora_expand import expand_launch
from slora.kernels.triton.lora_fused import fused_launch, fused_serves
from slora.kernels.triton.lora_shrink import shrink_launch
from slora.kernels.triton.relaunch import Relaunch

MAX_FUSED = 3  # modules the expand kernel adds in one launch


class LoraCall:
    """Shrink into v, then expand v into y, for x, y and a pool layer shaped like the ones it was built for."""

    def __init__(self, shrink: Relaunch, expand: Relaunch) -> None:
        self._shrink = shrink
        self._expand = expand

    def __call__(self, y: torch.Tensor, x: torch.Tensor, flat_layer: torch.Tensor) -> None:
        self._shrink(x, flat_layer)
        self._expand(flat_layer, y)

    def shrink(self, x: torch.Tensor, flat_layer: torch.Tensor) -> None:
        """The shrink alone, into v (benchmarks time the two kernels apart)."""
        self._shrink(x, flat_layer)

    def expand(self, y: torch.Tensor, flat_layer: torch.Tensor) -> None:
        """The expand alone, from the v of the last shrink."""
        self._expand(flat_layer, y)


class FusedCall:
    """Shrink and expand in one launch of the fused kernel, for x, y and a pool layer shaped like the ones it was
    built for."""

    def __init__(self, launch: Relaunch) -> None:
        self._launch = launch

    def __call__(self, y: torch.Tensor, x: torch.Tensor, flat_layer: torch.Tensor) -> None:
        self._launch(x, flat_layer, y)


def lora_calls(
    y: torch.Tensor,
    x: torch.Tensor,
    flat_layer: torch.Tensor,
    meta: LoraMeta,
    modules: tuple[int, ...],
    out_offsets: tuple[int, ...],
    out_widths: tuple[int, ...],
    settings: KernelSettings,
    pdl_shrink: bool = False,
) -> list[LoraCall | FusedCall]:
    """The launches of one call site, in order: one shrink and one expand per run of consecutive modules and per
    launch group of the step (meta.groups), or one fused launch for a group the fused kernel serves (fused_serves).
    pdl_shrink: y was just written by the Triton projection GEMM, so the
    shrinks may be launched with PDL behind it (kernels/triton/pdl.py)."""
    calls: list[LoraCall | FusedCall] = []
    # settings.lora_split (the default) launches a step's decodes and prompts apart: the decodes on the GEMV
    # kernels, the prompts on prompt tiles, one launch pair each; so does settings.lora_fused, whose kernel serves
    # the decodes. Off: one launch pair for both (SegmentGroup.tile_len picks decode-shaped tiles when a step has
    # both), which saves the host a launch pair on an eager step but spends a 16-row tile on each decode.
    groups = meta.groups(settings.lora_split or settings.lora_fused)
    for first, offsets, widths in consecutive_runs(modules, out_offsets, out_widths):
        if meta.fused_rank(first, len(widths)) == 0:
            continue  # no adapter of the step targets these modules
        for group in groups:
            if fused_serves(group, meta, settings):
                fused = fused_launch(y, x, flat_layer, meta, first, offsets, widths, group, pdl_shrink,
                                     settings=settings)  # fmt: skip
                if fused is not None:
                    calls.append(FusedCall(fused))
                continue
            v, shrink = shrink_launch(x, flat_layer, meta, first, len(widths), group, pdl=pdl_shrink, settings=settings)
            expand = expand_launch(y, v, flat_layer, meta, first, offsets, widths, group, settings=settings)
            if shrink is not None and expand is not None:
                calls.append(LoraCall(shrink, expand))
    return calls


def consecutive_runs(
    modules: tuple[int, ...], out_offsets: tuple[int, ...], out_widths: tuple[int, ...]
) -> Iterator[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(first module, offsets, widths) of each run of up to MAX_FUSED consecutive modules, in order."""
    start = 0
    for i in range(1, len(modules) + 1):
        run_ends = i == len(modules) or modules[i] != modules[i - 1] + 1 or i - start == MAX_FUSED
        if run_ends:
            yield modules[start], tuple(out_offsets[start:i]), tuple(out_widths[start:i])
            start = i
