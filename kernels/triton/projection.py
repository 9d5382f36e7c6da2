"""The model's projections (x·Wᵀ + bias): the Triton GEMM of kernels/triton/gemm.py for steps of up to 64 rows on
CUDA, F.linear (cuBLAS) for the rest.

At up to 64 rows a projection reads its weight once and does little arithmetic, so its time is the weight's bytes
over the bandwidth it reaches. On the H200 the Triton GEMM, with the config gemm.gemm_config picks, read the 7B
projections 2-8% faster than cuBLAS at up to 16 rows and even with it at 24-64 (perf.bench_lora_gemm); at 128 it was
15-32% behind. It also lets the LoRA shrink behind it start before it ends (triton/pdl.py), which cuBLAS does not:
whole 7B decode steps at 32 and 64 rows with S1 adapters ran 4.5-5.9% faster than on cuBLAS, 0.2-1.4% without
adapters (perf.bench_decode_step, perf/RESULTS.md session 16). Weights narrower than MIN_FEATURES were not measured
and stay on cuBLAS. SLORA_TRITON_GEMM=0 turns the Triton GEMM off.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F

from slora.kernels.triton.gemm import gemm_launch
from slora.kernels.triton.relaunch import Relaunch

ENV = "SLORA_TRITON_GEMM"
MAX_ROWS = 64
MIN_FEATURES = 2048  # in and out features: the shapes measured (7B projections) and larger


def triton_gemm_enabled() -> bool:
    """Whether SLORA_TRITON_GEMM (default on) lets small projections take the Triton GEMM."""
    return os.environ.get(ENV, "1") != "0"


class Projections:
    """x·Wᵀ + bias for the model, one Triton launch per shape built on first use and reused by every layer."""

    def __init__(self, triton_gemm: bool | None = None) -> None:
        self.triton_gemm = triton_gemm_enabled() if triton_gemm is None else triton_gemm
        self._launches: dict[tuple[object, ...], Relaunch] = {}
        self._last: weakref.ref[torch.Tensor] | None = None  # the last output, when the Triton GEMM wrote it

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x·Wᵀ + bias, into `out` (a contiguous [rows, N] tensor of x's dtype) when given, else a new tensor."""
        y = out
        if y is not None and (y.shape != (x.shape[0], weight.shape[0]) or not y.is_contiguous() or y.dtype != x.dtype):
            raise ValueError(f"out must be a contiguous {x.dtype} [{x.shape[0]}, {weight.shape[0]}] tensor")
        if not self.takes_triton(x, weight, bias):
            self._last = None
            if y is None:
                return F.linear(x, weight, bias)
            return torch.mm(x, weight.t(), out=y) if bias is None else torch.addmm(bias, x, weight.t(), out=y)
        if y is None:
            y = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
        key = (x.shape, x.stride(0), weight.shape, weight.stride(0), bias is None, x.dtype, x.device)
        launch = self._launches.get(key)
        if launch is None:
            launch = self._launches[key] = gemm_launch(x, weight, y, bias)
        if bias is None:
            launch(x, weight, y)
        else:
            launch(x, weight, y, bias)
        self._last = weakref.ref(y)
        return y

    def wrote_last(self, y: torch.Tensor) -> bool:
        """Whether y is the last projection's output and the Triton GEMM wrote it: then a LoRA shrink launched right
        behind it may be launched with PDL (pdl.py), which relies on how this GEMM starts its dependents."""
        return self._last is not None and self._last() is y

    def takes_triton(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether x·Wᵀ goes to the Triton GEMM: few rows on CUDA, a measured weight shape, 16-bit, unit strides."""
        return (
            self.triton_gemm
            and x.is_cuda
            and 0 < x.shape[0] <= MAX_ROWS
            and min(weight.shape) >= MIN_FEATURES
            and weight.shape[0] % 16 == 0
            and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype
            and x.dim() == 2
            and x.stride(1) == 1
            and weight.stride(1) == 1
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
        )
