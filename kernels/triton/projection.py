"""The model's projections (x·Wᵀ + bias): the Triton GEMM of kernels/triton/gemm.py for steps of up to 64 rows on
CUDA, F.linear (cuBLAS) for the rest.

At up to 64 rows a projection reads its weight once and does little arithmetic, so its time is the weight's bytes
over the bandwidth it reaches; there the Triton GEMM, with the config gemm.gemm_config picks, reads the 7B
projections at least as fast as cuBLAS, and beyond 64 rows cuBLAS is ahead (perf.bench_lora_gemm). It also lets the
LoRA shrink behind it start before it ends (triton/pdl.py), which cuBLAS does not. Weights narrower than
MIN_FEATURES stay on cuBLAS: the configs were swept on the 7B shapes only. KernelSettings.triton_gemm=False turns the
Triton GEMM off.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from slora.kernels.settings import KernelSettings
from slora.kernels.triton.gemm import gemm_launch
from slora.kernels.triton.pdl import shrink_pdl
from slora.kernels.triton.relaunch import Relaunch

MAX_ROWS = 64
MIN_FEATURES = 2048  # in and out features: the shapes its configs were swept on (7B projections) and larger


class Projections:
    """x·Wᵀ + bias for the model, one Triton launch per shape built on first use and reused by every layer."""

    def __init__(self, settings: KernelSettings) -> None:
        self.settings = settings  # the shrink's PDL behind this GEMM (gemm_launch's pdl)
        self.triton_gemm = settings.triton_gemm
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
            launch = self._launches[key] = gemm_launch(x, weight, y, bias, pdl=shrink_pdl(x.device, self.settings))
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
        """Whether x·Wᵀ goes to the Triton GEMM: few rows on CUDA, a swept weight shape, 16-bit, unit strides."""
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
