"""kernel_backend picks the ops: 'bmm' swaps only the LoRA for S-LoRA's padded baseline, keeping the Triton
kernels for attention, norms and RoPE on CUDA, so that an engine comparison isolates what the LoRA kernels buy."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from slora.kernels.ops import PaddedBmmOps, PaddedLora, TorchOps, make_ops  # noqa: E402
from slora.kernels.settings import KernelSettings  # noqa: E402
from slora.kernels.triton.ops import TritonOps, TritonPaddedBmmOps  # noqa: E402

OTHER_OPS = ("rms_norm", "rotary", "write_kv", "attention")


def test_bmm_on_triton_differs_from_triton_only_in_the_lora() -> None:
    assert TritonPaddedBmmOps.lora is PaddedLora.lora
    for op in OTHER_OPS:
        assert getattr(TritonPaddedBmmOps, op) is getattr(TritonOps, op), op
    assert TritonPaddedBmmOps.name == "bmm"


def test_bmm_without_cuda_uses_the_torch_references() -> None:
    ops = make_ops("bmm", torch.device("cpu"), KernelSettings())
    assert isinstance(ops, PaddedBmmOps)
    for op in OTHER_OPS:
        assert getattr(PaddedBmmOps, op) is getattr(TorchOps, op), op


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bmm_on_cuda_runs_the_triton_kernels_for_the_rest() -> None:
    assert isinstance(make_ops("bmm", torch.device("cuda"), KernelSettings()), TritonPaddedBmmOps)


def test_the_triton_ops_carry_the_settings() -> None:
    """make_ops hands the kernel settings to the Triton ops it builds (and so to their projections)."""
    settings = KernelSettings(triton_gemm=False, lora_split=True)
    ops = make_ops("triton", torch.device("cpu"), settings)
    assert isinstance(ops, TritonOps) and ops.settings is settings and not ops.projections.triton_gemm
