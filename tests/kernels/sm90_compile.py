"""Compile every kernel launch of real-shaped steps for the H100/H200 (sm_90), on a machine with no GPU.

The interpreter checks what kernels compute, not whether Triton can compile them (tile shapes tl.dot accepts,
globals, types) nor how much shared memory they take. Here the launchers run for real on full shapes, but each
launch is captured instead of run, then compiled ahead of time for sm_90 with the arguments' types and the
divisibility Triton's launcher would specialize on. Needs Triton's NVIDIA backend (ptxas ships in its wheel).

Run as `python -m tests.kernels.sm90_compile SCENARIO`, in a process without TRITON_INTERPRET: under the
interpreter triton.language's own helpers are interpreted functions, which the compiler cannot use.
Exit status: 0 compiled, 1 a kernel failed, 3 this machine cannot compile for NVIDIA GPUs at all.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from slora.kernels.settings import KernelSettings
from slora.kernels.triton import lora_expand, pdl, rotary
from slora.kernels.triton.gemm import gemm_launch
from slora.kernels.triton.jit_stats import kernels_replaced
from slora.kernels.triton.lora_call import consecutive_runs, lora_calls
from slora.kernels.triton.lora_fused import fused_lora
from slora.kernels.triton.ops import TritonOps
from tests.kernels.builders import Shape, attention_step
from tests.kernels.test_attention import Heads, make_pool
from tests.kernels.test_lora import build_case, layer_calls

logger = logging.getLogger(__name__)


MAX_SHARED = 227 * 1024  # bytes of shared memory one block may use on sm_90
POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32"}
POINTER[torch.int64] = "*i64"

LLAMA_7B = Shape(4096, 11008, 32, 32, 128)
LLAMA3_8B = Shape(4096, 14336, 32, 8, 128)


class Launch:
    """One captured `kernel[grid](*args, **kwargs)` call (arguments by position or by name)."""

    def __init__(self, kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.fn = JITFunction(kernel.fn)
        self.options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl") if k in kwargs}
        named = dict(zip(self.fn.arg_names, args)) | kwargs
        self.constexprs = {p.name: named[p.name] for p in self.fn.params if p.is_constexpr}
        self.values = {p.name: named[p.name] for p in self.fn.params if not p.is_constexpr}

    def signature(self) -> tuple[dict[str, str], dict[tuple[int, ...], list[list[Any]]]]:
        values = self.values
        signature, attrs = {}, {}
        for i, name in enumerate(self.fn.arg_names):
            if name in self.constexprs:
                signature[name] = "constexpr"
                continue
            value = values[name]
            if isinstance(value, torch.Tensor):
                signature[name] = POINTER[value.dtype]
                aligned = value.data_ptr() % 16 == 0
            elif isinstance(value, int):
                signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
                aligned = value % 16 == 0
            else:
                signature[name], aligned = "fp32", False
            if aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
        return signature, attrs

    def key(self) -> str:
        return f"{self.fn.fn.__name__} {self.signature()} {sorted(self.constexprs.items())} {self.options}"


def capture(run: Callable[[], object]) -> list[Launch]:
    """Run `run` with every kernel replaced by a recorder of its launches."""
    launches: list[Launch] = []

    class Recorder:
        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel
            self.arg_names = kernel.arg_names
            self.__name__ = kernel.__name__

        def __getitem__(self, grid: object) -> Callable[..., None]:
            return lambda *args, **kwargs: launches.append(Launch(self.kernel, args, kwargs))

    with kernels_replaced(Recorder):
        run()
    return launches


def lora_layer(shape: Shape, dtype: torch.dtype, step: list[tuple[int | None, int]]) -> Callable[[], None]:
    ranks = [(16, 8, 8, 16, 0, 0, 0), (64, 64, 64, 64, 64, 64, 64), (1, 0, 1, 0, 3, 3, 3)]
    case = build_case(shape, dtype, ranks, step, seed=1)

    def run() -> None:
        for modules, offsets, widths, in_features in layer_calls(shape):
            x = torch.zeros((case.num_tokens, in_features), dtype=dtype)
            y = torch.zeros((case.num_tokens, sum(widths)), dtype=dtype)
            TritonOps().lora(y, x, case.flat_layer, case.meta, modules, offsets, widths)

    return run


def attention(heads: Heads, block_size: int, dtype: torch.dtype, step: list[tuple[int, int]]) -> Callable[[], None]:
    pool = make_pool(heads, block_size, dtype, sum(n for _, n in step) + block_size * len(step), seed=0)
    batch = attention_step(pool, [q for q, _ in step], [n for _, n in step])
    q = torch.zeros((batch.num_tokens, heads.heads, heads.head_dim), dtype=dtype)
    k = torch.zeros((batch.num_tokens, heads.kv_heads, heads.head_dim), dtype=dtype)

    def run() -> None:
        ops = TritonOps()
        ops.write_kv(k, k, pool.kv_layer(0), batch.attn)
        ops.attention(q, pool.kv_layer(0), batch.attn, heads.head_dim**-0.5)

    return run


def rotary_write_kv(heads: Heads, block_size: int, dtype: torch.dtype) -> Callable[[], None]:
    """RoPE alone, and RoPE fused with the K/V write (the same kernel, WRITE_KV off and on)."""
    num_tokens, d = 5, heads.head_dim
    q = torch.zeros((num_tokens, heads.heads, d), dtype=dtype)
    k = torch.zeros((num_tokens, heads.kv_heads, d), dtype=dtype)
    positions = torch.arange(num_tokens)
    table = torch.zeros((64, d), dtype=dtype)
    pool = torch.zeros((4, 2, block_size, heads.kv_heads, d), dtype=dtype)

    def run() -> None:
        ops = TritonOps()
        ops.rotary(q, k, positions, table, table)
        rotary.apply_rotary_write_kv_(q, k, k, positions, table, table, pool, positions)

    return run


def norm_silu_mul() -> Callable[[], None]:
    """RMSNorm with and without the residual, and SiLU·up, at the 7B layer's widths."""

    def run() -> None:
        ops = TritonOps()
        x = torch.zeros((3, 4096), dtype=torch.bfloat16)
        ops.rms_norm(x, x[0], 1e-5)
        ops.rms_norm(x, x[0], 1e-5, x)
        ops.silu_mul(torch.zeros((3, 2 * 11008), dtype=torch.bfloat16), 11008)

    return run


def projections(rows: int) -> Callable[[], None]:
    """The 7B projections at `rows` rows on the Triton GEMM, with the configs the engine picks (and a bias)."""

    def run() -> None:
        for n, k in ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)):
            x, w, y = (torch.zeros(shape, dtype=torch.bfloat16) for shape in ((rows, k), (n, k), (rows, n)))
            shrink_pdl = pdl.shrink_pdl(x.device, KernelSettings())  # as the engine's projections ask
            if n == 12288:
                bias = torch.zeros(n, dtype=torch.bfloat16)
                gemm_launch(x, w, y, bias, pdl=shrink_pdl)(x, w, y, bias)
            else:
                gemm_launch(x, w, y, pdl=shrink_pdl)(x, w, y)

    return run


def lora_fused(shape: Shape, step: list[tuple[int | None, int]]) -> Callable[[], None]:
    """The fused LoRA kernel (a benchmark candidate) over a layer's calls."""
    ranks = [(16, 8, 8, 16, 0, 0, 0), (64, 64, 64, 64, 64, 64, 64), (1, 0, 1, 0, 3, 3, 3)]
    case = build_case(shape, torch.bfloat16, ranks, step, seed=1)

    def run() -> None:
        for modules, offsets, widths, in_features in layer_calls(shape):
            x = torch.zeros((case.num_tokens, in_features), dtype=torch.bfloat16)
            y = torch.zeros((case.num_tokens, sum(widths)), dtype=torch.bfloat16)
            for first, run_offsets, run_widths in consecutive_runs(modules, offsets, widths):
                fused_lora(y, x, case.flat_layer, case.meta, first, run_offsets, run_widths)

    return run


def lora_fused_engine(shape: Shape, step: list[tuple[int | None, int]]) -> Callable[[], None]:
    """A layer's calls as the engine launches them with lora_fused (ranks the fused kernel serves), each call built
    as behind the Triton GEMM (pdl_shrink)."""
    ranks = [(16, 8, 8, 16, 0, 0, 0), (4,) * 7, (1, 0, 1, 0, 3, 3, 3)]
    case = build_case(shape, torch.bfloat16, ranks, step, seed=1)
    settings = KernelSettings(lora_fused=True)

    def run() -> None:
        for modules, offsets, widths, in_features in layer_calls(shape):
            x = torch.zeros((case.num_tokens, in_features), dtype=torch.bfloat16)
            y = torch.zeros((case.num_tokens, sum(widths)), dtype=torch.bfloat16)
            calls = lora_calls(y, x, case.flat_layer, case.meta, modules, offsets, widths, settings, pdl_shrink=True)
            for call in calls:
                call(y, x, case.flat_layer)

    return run


def with_pdl(run: Callable[[], None]) -> Callable[[], None]:
    """`run` with the launches an sm_90 GPU makes: PDL on (kernels/triton/pdl.py), which the CPU never turns on."""

    def run_with_pdl() -> None:
        def supported(device: torch.device) -> bool:
            return True

        with mock.patch.object(pdl, "device_supports_pdl", supported):
            run()

    return run_with_pdl


def with_expand_prefetch(run: Callable[[], None]) -> Callable[[], None]:
    """`run` with the tensor-core expand reading its first Bᵀ chunk before the wait (ExpandConfig.prefetch)."""

    def run_with_prefetch() -> None:
        with (
            mock.patch.object(lora_expand, "MIXED", dataclasses.replace(lora_expand.MIXED, prefetch=True)),
            mock.patch.object(lora_expand, "PREFILL", dataclasses.replace(lora_expand.PREFILL, prefetch=True)),
        ):
            run()

    return run_with_prefetch


DECODE = [(0, 1), (1, 1), (2, 1), (None, 1), (1, 1)]
PREFILL = [(1, 100), (None, 3), (0, 1)]
SCENARIOS = {
    "lora-decode-bf16": lambda: lora_layer(LLAMA_7B, torch.bfloat16, DECODE),
    "lora-prefill-bf16": lambda: lora_layer(LLAMA_7B, torch.bfloat16, PREFILL),
    "lora-decode-pdl-bf16": lambda: with_pdl(lora_layer(LLAMA_7B, torch.bfloat16, DECODE)),
    "lora-prefill-pdl-bf16": lambda: with_pdl(lora_layer(LLAMA_7B, torch.bfloat16, PREFILL)),
    "lora-mixed-prefetch-pdl-bf16": lambda: with_pdl(
        with_expand_prefetch(lora_layer(LLAMA3_8B, torch.bfloat16, PREFILL))
    ),  # fmt: skip
    "projections-1-pdl-bf16": lambda: with_pdl(projections(1)),
    "lora-fused-bf16": lambda: lora_fused(LLAMA3_8B, PREFILL),
    "lora-fused-engine-pdl-bf16": lambda: with_pdl(lora_fused_engine(LLAMA3_8B, DECODE + PREFILL)),
    "lora-decode-fp32": lambda: lora_layer(Shape(576, 1536, 9, 3, 64), torch.float32, DECODE),
    "attention-decode-split-bf16": lambda: attention(Heads(32, 8, 128), 16, torch.bfloat16, [(1, 4000)]),
    "attention-mixed-bf16": lambda: attention(Heads(32, 32, 128), 32, torch.bfloat16, [(100, 300), (1, 50)]),
    "attention-decode-fp32": lambda: attention(Heads(9, 3, 64), 4, torch.float32, [(1, 30), (1, 7)]),
    "rotary-write-kv-bf16": lambda: rotary_write_kv(Heads(32, 8, 128), 16, torch.bfloat16),
    "norm-silu-mul-bf16": norm_silu_mul,
    "projections-1-bf16": lambda: projections(1),
    "projections-64-bf16": lambda: projections(64),
}


def compile_sm90(launch: Launch) -> Any:
    signature, attrs = launch.signature()
    source = ASTSource(launch.fn, signature, launch.constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch.options)


@triton.jit
def _probe(x_ptr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    tl.store(x_ptr + tl.arange(0, BLOCK), tl.arange(0, BLOCK))


def can_compile() -> bool:
    try:
        source = ASTSource(JITFunction(_probe.fn), {"x_ptr": "*i32", "BLOCK": "constexpr"}, {"BLOCK": 16})
        triton.compile(source, target=GPUTarget("cuda", 90, 32))
    except Exception as exc:  # noqa: BLE001 - any failure here means no NVIDIA toolchain, not a kernel bug
        logger.warning("cannot compile for sm_90 here: %s", exc)
        return False
    return True


def main(scenario: str) -> int:
    if not can_compile():
        return 3
    unique = {launch.key(): launch for launch in capture(SCENARIOS[scenario]())}
    if not unique:
        logger.error("%s launched no kernel", scenario)
        return 1
    failed = 0
    for key, launch in unique.items():
        try:
            shared = compile_sm90(launch).metadata.shared
        except Exception:
            logger.exception("%s does not compile", key)
            failed += 1
            continue
        if shared > MAX_SHARED:
            logger.error("%s needs %d bytes of shared memory (at most %d)", key, shared, MAX_SHARED)
            failed += 1
    logger.info("%s: %d kernel variants, %d failed", scenario, len(unique), failed)
    return 1 if failed else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    sys.exit(main(sys.argv[1]))
