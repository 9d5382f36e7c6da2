"""LoRA shrinks on a second CUDA stream, beside the base projection they share their input with.

A LoRA call site needs the base projection's output y only for its expand: the shrink (v = x·A) reads just x. At
decode batch sizes the base GEMM's grid may leave SMs idle (a GEMM of ~100 rows and 12288 columns in 192 × 160
tiles has 77 of them for the H200's 132 SMs; what cuBLAS picks and how busy the SMs are was not measured), so the
shrink can run beside it:

    main stream:   ... x ──────────► y = x·Wᵀ ──────────► wait(shrunk) ──► y += v·B·scale ──► ...
    side stream:        wait(x) ──► v = x·A ──► shrunk

Only decode CUDA graphs use it (DecoderModel._lora_begin): captured, the fork and join (the side stream waits on
the capturing stream first, and the capturing stream waits on it before the expand) become two branches of the
graph and cost no host time per step, while eager steps would pay for the stream switches at every call site. The
expands are launched without PDL: the kernel before them in their stream is the GEMM that writes y
(kernels/lora_expand.py). EngineConfig.lora_overlap, with cuda_graphs (CUDA and the Triton kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slora.kernels.lora_call import LoraCall
from slora.kernels.triton_ops import TritonOps


@dataclass
class PendingLora:
    """A call site whose shrinks are launched on the side stream; `finish` adds its expands into y."""

    calls: list[LoraCall]
    shrunk: torch.cuda.Event
    flat_layer: torch.Tensor


class LoraOverlap:
    def __init__(self, ops: TritonOps, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"overlapped LoRA needs a CUDA device, not {device}")
        self.ops = ops
        self.side = torch.cuda.Stream(device)

    def begin(self, calls: list[LoraCall], x: torch.Tensor, flat_layer: torch.Tensor) -> PendingLora:
        """Launch the shrinks of a call site's `calls` (TritonOps.lora_apart, built on the current stream) on the side
        stream, once x is written: call before the base GEMM."""
        self.side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(self.side):
            for call in calls:
                call.shrink(x, flat_layer)
        shrunk = torch.cuda.Event()
        shrunk.record(self.side)
        return PendingLora(calls, shrunk, flat_layer)

    def finish(self, pending: PendingLora, y: torch.Tensor) -> None:
        """Add the expands into y (the base GEMM's output) on the current stream, after the shrinks."""
        torch.cuda.current_stream(y.device).wait_event(pending.shrunk)
        for call in pending.calls:
            call.expand(y, pending.flat_layer)
