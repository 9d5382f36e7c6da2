"""Programmatic dependent launch (PDL) of the LoRA kernels: the shrink behind the base projection, the expand behind
the shrink.

A decode step's LoRA call is two short kernels, shrink then expand, each a few tens of microseconds and bound by
the latency of its first loads as much as by bandwidth; each launch in a CUDA graph also costs the gap between one
kernel's end and the next one's start. Launched with PDL (Hopper and later), a kernel's programs start before the
kernel in front of it has ended, as soon as that kernel's programs have all started and called
griddepcontrol.launch_dependents (or have ended), and wait for its end with griddepcontrol.wait:

- the shrink, right behind the Triton GEMM of small steps (kernels/triton/projection.py) that computed the projection of
  its input x: it reads x and the adapters' A rows and writes its own v, none of which the GEMM writes, so it needs
  no wait before that work. It waits at its end, so that its end implies the GEMM's: the expand behind it adds
  into the GEMM's output. The GEMM lets it start as soon as all of the GEMM's programs run. Behind cuBLAS, whose
  launches we do not control, the shrink is launched without PDL: TritonOps asks Projections.wrote_last whether
  the Triton GEMM wrote the y at hand;
- the expand, behind the shrink: it reads its first rank chunk of Bᵀ, then waits, then reads v and y.

So nothing a LoRA kernel reads before its wait may be written by a kernel that is still running: x was written
before the GEMM in front of the shrink started (the GEMM, launched without PDL, started after its own predecessors
had ended). Building a call site's launches (a step's first layer) puts only copies between the GEMM and the
shrink, which PDL does not overlap: the tiles and the tensor-core shrink's zeroed arrival counters come from the
host. (A kernel that zeroed the counters there could still be running when the shrink starts, and a shrink that
waited for it before its counters would lose most of the overlap.) Both instructions are no-ops on a launch without
PDL, so the kernels stay correct when it is off (KernelSettings.lora_pdl=False for all of it, shrink_pdl=False for
the shrink's launch alone, an older GPU or Triton, the CPU interpreter).
"""

from __future__ import annotations

import functools

import torch

from slora.kernels.settings import KernelSettings, triton_interpreted


def pdl_enabled(device: torch.device, settings: KernelSettings) -> bool:
    """Whether LoRA launches on `device` use PDL: settings.lora_pdl, on a device that supports it."""
    return settings.lora_pdl and device_supports_pdl(device)


def shrink_pdl(device: torch.device, settings: KernelSettings) -> bool:
    """Whether the LoRA shrink on `device` is launched with PDL behind the base projection: pdl_enabled, and
    settings.shrink_pdl."""
    return settings.shrink_pdl and pdl_enabled(device, settings)


@functools.lru_cache(maxsize=16)
def device_supports_pdl(device: torch.device) -> bool:
    """A CUDA GPU of compute capability 9 or later, a Triton that can launch with PDL, and not the interpreter.
    Cached: every LoRA launch asks."""
    if device.type != "cuda" or triton_interpreted():
        return False
    if torch.cuda.get_device_capability(device)[0] < 9:
        return False
    return _triton_has_pdl()


def _triton_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
