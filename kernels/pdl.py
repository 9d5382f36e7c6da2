"""Programmatic dependent launch (PDL) of the LoRA expand kernel behind its shrink kernel.

A decode step's LoRA call is two short kernels, shrink then expand, each a few tens of microseconds and bound by
the latency of its first loads as much as by bandwidth. The expand's Bᵀ rows do not depend on the shrink's output:
launched with PDL (Hopper and later), the expand's programs start while the shrink still runs, read their first
rank chunk of Bᵀ, and only then wait (griddepcontrol.wait) for the shrink to finish and its v to be visible. The
shrink lets them start as soon as all its programs are running (griddepcontrol.launch_dependents).

The wait is the only ordering the expand gets: nothing it reads before the wait may be written by the shrink or by
the kernels before it that are still running. Both instructions are no-ops on a launch without PDL, so the kernels
stay correct when it is off (SLORA_LORA_PDL=0, an older GPU or Triton, the CPU interpreter).
"""

from __future__ import annotations

import functools
import os

import torch

ENV = "SLORA_LORA_PDL"  # "0" turns PDL off (to compare, or if a driver mishandles it)


@functools.lru_cache(maxsize=16)
def pdl_enabled(device: torch.device) -> bool:
    """Whether LoRA launches on `device` use PDL: a CUDA GPU of compute capability 9 or later, a Triton that can
    launch with PDL, not the interpreter, and not turned off through SLORA_LORA_PDL=0."""
    if device.type != "cuda" or os.environ.get(ENV, "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
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
