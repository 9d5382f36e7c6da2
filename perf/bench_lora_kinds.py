"""Decode steps whose adapters each have many tokens: the GEMV kernels' tile sizes against the tensor-core kernels.

A step of decodes only goes to the GEMV LoRA kernels (lora_shrink.DECODE), which read an adapter's rows once per
token (from cache after the first), on tiles of one token; with tiles of 4 a program runs its tokens one after the
other. When a few adapters serve the whole batch (S-LoRA's small-n and skewed-α workloads), the tensor-core kernels
read them once per tile of 16 tokens instead. This times one decoder layer's four LoRA calls each way, on the same
steps, to decide which kernels such steps should use. --behind-gemm times them behind their base projections, as
the engine runs them (the shrink launched with PDL behind the Triton GEMM), less the projections' own time.

    python -m perf.bench_lora_kinds --out lora_kinds.json [--behind-gemm]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from perf import bench_kernels
from perf.bench_kernels import (
    LLAMA_7B,
    S1,
    LoraCase,
    Model,
    adapters,
    call_outputs,
    lora_calls,
    lora_case,
    s2_adapters,
    timed,
)
from perf.bench_lora_gemm import few, projections, weights
from slora.kernels.metadata import SHORT_SEGMENT
from slora.kernels.settings import DEFAULT_SETTINGS, KernelSettings
from slora.kernels.triton import lora_expand, lora_shrink
from slora.kernels.triton.ops import TritonOps

logger = logging.getLogger(__name__)

# GEMV kinds: (shrink, expand) tokens per tile; gemv4 was the default until ㊶. "tensor": the mixed steps' configs.
GEMV_TILES = {"gemv": (1, 1), "gemv2": (2, 2), "gemv4": (4, 4), "shrink1_expand4": (1, 4), "shrink4_expand1": (4, 1)}
KINDS = (*GEMV_TILES, "tensor")


# Steps of few adapters stay decode steps (no KernelSettings.few_adapters rule), so that each kind runs them.
NO_FEW_ADAPTERS_RULE = KernelSettings(few_adapters_max=0)


@contextlib.contextmanager
def decode_kernels(kind: str) -> Iterator[None]:
    """Decode steps through the GEMV kernels on tiles of GEMV_TILES[kind] tokens for the shrink and the expand (each
    program runs its tile's tokens one after the other; the default: one-token tiles), or the tensor-core ones.
    Time them with NO_FEW_ADAPTERS_RULE, so that steps of few adapters take the decode configs too."""
    saved = [(m, name, getattr(m, name)) for m in (lora_shrink, lora_expand) for name in ("DECODE", "DECODE_ONE")]
    try:
        for module, name, config in saved:
            if kind == "tensor":
                setattr(module, name, module.MIXED)
            else:
                block = GEMV_TILES[kind][0 if module is lora_shrink else 1]
                setattr(module, name, dataclasses.replace(config, block_m=block))
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


@dataclasses.dataclass
class LayerFns:
    """The layer's LoRA calls (layer), its base projections alone (base), and each call's (y, x, modules,
    offsets, widths)."""

    layer: Callable[[], None]
    base: Callable[[], None]
    calls: list[tuple[torch.Tensor, torch.Tensor, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


def layer_fns(
    case: LoraCase,
    weights: dict[tuple[int, ...], torch.Tensor] | None = None,
    settings: KernelSettings = DEFAULT_SETTINGS,
) -> LayerFns:
    """The layer's four LoRA calls as one function, launches built afresh, on ops of `settings`. With `weights` (by
    the call's modules), each call runs behind its base projection on the engine's projections (TritonOps.projections:
    the Triton GEMM up to 64 rows, whose LoRA shrink is launched with PDL, triton/pdl.py), and `base` runs the
    projections alone."""
    ops = TritonOps(settings)
    calls = []
    for _, modules, in_features in lora_calls(case.model):
        offsets, widths = call_outputs(case.model, modules)
        x = torch.randn((case.num_tokens, in_features), device=bench_kernels.DEVICE).to(torch.bfloat16)
        y = torch.zeros((case.num_tokens, sum(widths)), device=bench_kernels.DEVICE).to(torch.bfloat16)
        calls.append((y, x, modules, offsets, widths))

    def base() -> None:
        for y, x, modules, *_ in calls:
            if weights is not None:
                ops.projections(x, weights[modules], out=y)

    def layer() -> None:
        for y, x, modules, offsets, widths in calls:
            if weights is not None:
                ops.projections(x, weights[modules], out=y)
            ops.lora(y, x, case.flat_layer, case.meta, modules, offsets, widths)

    case.meta.launches.clear()
    return LayerFns(layer, base, calls)


def layer_ms(case: LoraCase, weights: dict[tuple[int, ...], torch.Tensor] | None, settings: KernelSettings) -> float:
    """Device time of the layer's four LoRA calls (graph replay); with `weights`, behind their projections, less
    the projections' own time (layer_fns)."""
    fns = layer_fns(case, weights, settings)
    return timed(fns.layer)[0] - (timed(fns.base)[0] if weights is not None else 0.0)


def projection_weights(model: Model) -> dict[tuple[int, ...], torch.Tensor]:
    """Random base weights of the layer's four projections (bench_lora_gemm.weights), by the LoRA call's modules."""
    by_name = weights(model, torch.Generator(device=bench_kernels.DEVICE).manual_seed(0))
    return {modules: by_name[name] for name, modules, _, _ in projections(model)}


def cases(tokens: int) -> list[tuple[str, list[tuple[int, ...]]]]:
    """(name, adapters' ranks) of decode steps of `tokens` requests spread round robin over the adapters: few
    adapters, and one adapter per request to compare. Only steps of up to SHORT_SEGMENT tokens per adapter: an eager
    step with more is not a decode group (metadata.SegmentGroup.kind) and gets prompt tiles whatever the decode
    configs are, so it would compare nothing."""
    named: list[tuple[str, list[tuple[int, ...]]]] = [
        (f"{tokens} decodes, 1 adapter S2 r64", s2_adapters(1)),
        (f"{tokens} decodes, 4 adapters r64 all modules", adapters([64] * 4)),
        (f"{tokens} decodes, 5 adapters S2", s2_adapters(5)),
        (f"{tokens} decodes, 5 adapters S1", [S1] * 5),
        (f"{tokens} decodes, 24 adapters S2", s2_adapters(24)),
        (f"{tokens} decodes, {tokens} adapters S2", s2_adapters(tokens)),
    ]
    return [(name, ranks) for name, ranks in named if -(-tokens // len(ranks)) <= SHORT_SEGMENT]


def run(tokens: list[int], behind_gemm: bool = False) -> list[dict[str, Any]]:
    rows = []
    weights = projection_weights(LLAMA_7B) if behind_gemm else None
    for n in tokens:
        for name, ranks in cases(n):
            case = lora_case(name, LLAMA_7B, ranks, few(n, len(ranks)))
            row: dict[str, Any] = {"case": name, "behind_gemm": behind_gemm}
            for kind in KINDS:
                with decode_kernels(kind):
                    row[f"{kind}_ms"] = layer_ms(case, weights, NO_FEW_ADAPTERS_RULE)
            logger.info("%-44s %s", name, "  ".join(f"{kind} {row[f'{kind}_ms']:.4f}" for kind in KINDS))
            rows.append(row)
            del case
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64])
    parser.add_argument(
        "--behind-gemm", action="store_true",
        help="time the LoRA behind its base projections (the engine's), less theirs: the shrink's PDL overlap",
    )  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not torch.cuda.is_available():
        logger.error("bench_lora_kinds needs a CUDA GPU")
        return 2
    rows = run(args.tokens, args.behind_gemm)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
