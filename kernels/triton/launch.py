"""Small helpers shared by the kernel launchers.

Triton compiles one variant of a kernel per class of its integer arguments (equal to 1, a multiple of 16, other).
Arguments that change from step to step without any gain from that (K-split counts, block-table widths,
strides that scale with the number of tokens, partition counts) are listed in each kernel's do_not_specialize,
so that a server does not stall on compiles as its batches change.
"""

from __future__ import annotations

import functools
import math

import torch

LOG2E = math.log2(math.e)  # kernels use exp2: exp(x) == exp2(x * LOG2E)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: exact ("ieee") for float32 inputs, so no silent tf32 rounding; moot for 16-bit."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=16)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a small stand-in for the CPU interpreter. Cached: eager decode
    steps ask once per layer."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code: triton.cdiv is a constexpr function, whose wrapper costs microseconds per call
    (a launch computes several of these)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), for host code (see cdiv)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
