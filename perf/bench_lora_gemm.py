"""Decode steps' projections on the Triton GEMM (kernels/triton/gemm.py) against cuBLAS, and a decoder layer's LoRA
behind each.

Part 1, the base GEMM alone: each 7B projection (q/k/v, o, gate/up, down) at M = 1 to 128 rows, cuBLAS (torch.mm)
against the Triton kernel in a few configs; time and the fraction of copy bandwidth on the weight bytes.

Part 2, one decoder layer of a decode step (the four projections and their LoRA):
  cublas        torch.mm only (no adapter)
  cublas+lora   torch.mm, then the LoRA's shrink and expand launches (TritonOps.lora: the engine's path above 64
                rows)
  triton        the engine's projections only (TritonOps.projections: the Triton GEMM at up to 64 rows)
  triton+lora   the same, then the LoRA's launches (the engine's path at up to 64 rows, the shrink launched with
                PDL: kernels/triton/pdl.py)
The LoRA's time is a path's time minus its base GEMM's (triton+lora: the triton row; the others: the cublas row);
its fraction of copy bandwidth is on the LoRA's minimum bytes (perf.bench_kernels.lora_minimum), as issue 4's decode
LoRA target counts it. GPU time from CUDA-graph replay with the L2 flushed before each layer
(perf.bench_kernels.graph_bench).

    python -m perf.bench_lora_gemm --out lora_gemm.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from perf import bench_kernels
from perf.bench_kernels import (
    LLAMA_7B,
    S1,
    TINY_MHA,
    LoraCase,
    Model,
    adapters,
    call_outputs,
    graph_bench,
    lora_calls,
    lora_case,
    lora_minimum,
    measure_device,
    s2_adapters,
)
from slora.kernels.triton import pdl
from slora.kernels.triton.gemm import GemmConfig, gemm_launch
from slora.kernels.triton.ops import TritonOps

logger = logging.getLogger("bench_lora_gemm")

ROWS: tuple[int, ...] = (1, 16, 64, 128)
CONFIGS = [
    GemmConfig(m, n, k, warps, stages)
    for m, n, k, warps, stages in [
        (128, 32, 128, 4, 4), (128, 32, 256, 4, 4), (128, 64, 256, 4, 4), (128, 64, 128, 4, 3), (128, 64, 128, 4, 5),
        (128, 128, 128, 4, 4), (128, 128, 64, 4, 4), (128, 32, 256, 4, 6), (128, 128, 64, 8, 4), (128, 64, 128, 8, 4),
        (128, 32, 256, 8, 4), (64, 64, 128, 4, 4), (64, 32, 256, 4, 4), (128, 16, 256, 4, 4), (128, 16, 512, 4, 3),
        (32, 64, 128, 4, 4), (32, 32, 256, 4, 4),
    ]
]  # fmt: skip


def projections(model: Model) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(name, modules, in_features, out_features) of the layer's four projections."""
    return [(name, modules, k, sum(call_outputs(model, modules)[1])) for name, modules, k in lora_calls(model)]


def weights(model: Model, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        name: (torch.randn((n, k), generator=gen, device=bench_kernels.DEVICE) * 0.02).to(torch.bfloat16)
        for name, _, k, n in projections(model)
    }


def gemm_sweep(model: Model, copy_gbps: float, gen: torch.Generator) -> list[dict[str, Any]]:
    """Part 1: every projection and row count, cuBLAS and each config (best first per shape in the log)."""
    results: list[dict[str, Any]] = []
    w = weights(model, gen)
    shrink_pdl = pdl.shrink_pdl(bench_kernels.DEVICE, bench_kernels.kernel_settings)  # as the engine's projections
    for name, modules, k, n in projections(model):
        widths = call_outputs(model, modules)[1]
        for m in ROWS:
            x = torch.randn((m, k), generator=gen, device=bench_kernels.DEVICE).to(torch.bfloat16)
            y = torch.empty((m, n), dtype=torch.bfloat16, device=bench_kernels.DEVICE)
            weight = w[name]
            nbytes = weight.numel() * 2 + x.numel() * 2 + y.numel() * 2
            runs: dict[str, Callable[[], object]] = {"cublas": functools.partial(torch.mm, x, weight.t(), out=y)}
            for cfg in CONFIGS:
                launch = gemm_launch(x, weight, y, cfg=cfg, widths=widths, pdl=shrink_pdl)
                runs[repr(cfg)] = functools.partial(launch, x, weight, y)
            shape: list[dict[str, Any]] = []
            for impl, fn in runs.items():
                ms = timed_ms(fn)
                entry = {"projection": name, "m": m, "n": n, "k": k, "impl": impl, "ms": ms}
                entry["frac_copy"] = None if ms is None else nbytes / (ms / 1e3) / 1e9 / copy_gbps
                shape.append(entry)
            results += shape
            ranked = sorted((e for e in shape if e["ms"] is not None), key=lambda e: float(e["ms"]))
            logger.info(
                "%s m=%d: cublas %.4f ms; best %s %.4f ms (%.0f%% copy)", name, m,
                next(e["ms"] for e in shape if e["impl"] == "cublas"), ranked[0]["impl"], ranked[0]["ms"],
                100 * ranked[0]["frac_copy"],
            )  # fmt: skip
    return results


def timed_ms(fn: Callable[[], object]) -> float | None:
    """Graph-replay GPU time (one timed call on the CPU: --smoke), or None for a config that cannot run (e.g. too
    much shared memory)."""
    if bench_kernels.DEVICE.type != "cuda":
        return bench_kernels.bench(fn)
    try:
        return graph_bench(fn)
    except Exception as exc:  # noqa: BLE001 - a config's compile or launch failure is a result, recorded as such
        logger.info("failed: %s", str(exc).splitlines()[0][:160])
        torch.cuda.synchronize()
        return None


SMOKE_CONFIGS = [GemmConfig(16, 32, 32, 4, 2)]


def layer_paths(case: LoraCase, w: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, Any]:
    """Part 2's paths on one layer, as functions of no argument, and the calls they run (for
    check_against_engine)."""
    model, device = case.model, bench_kernels.DEVICE
    ops = TritonOps(bench_kernels.kernel_settings)
    calls = []
    for name, modules, k, n in projections(model):
        offsets, widths = call_outputs(model, modules)
        x = torch.randn((case.num_tokens, k), generator=gen, device=device).to(torch.bfloat16)
        y = torch.empty((case.num_tokens, n), dtype=torch.bfloat16, device=device)
        calls.append((x, y, w[name], modules, offsets, widths))

    def cublas() -> None:
        for x, y, weight, *_ in calls:
            torch.mm(x, weight.t(), out=y)

    def cublas_lora() -> None:
        for x, y, weight, modules, offsets, widths in calls:
            torch.mm(x, weight.t(), out=y)
            ops.lora(y, x, case.flat_layer, case.meta, modules, offsets, widths)

    def triton_only() -> None:  # the engine's projections (TritonOps.projections: the Triton GEMM up to 64 rows)
        for x, y, weight, *_ in calls:
            ops.projections(x, weight, out=y)

    def triton_lora() -> (
        None
    ):  # and its LoRA, the shrink launched with PDL behind the Triton GEMM (kernels/triton/pdl.py)
        for x, y, weight, modules, offsets, widths in calls:
            ops.projections(x, weight, out=y)
            ops.lora(y, x, case.flat_layer, case.meta, modules, offsets, widths)

    return {"cublas": cublas, "cublas+lora": cublas_lora, "triton": triton_only, "triton+lora": triton_lora,
            "calls": calls}  # fmt: skip


def check_against_engine(paths: dict[str, Any], names: list[str]) -> float | None:
    """Largest difference between the y of the named paths and cuBLAS + LoRA launches', relative to the largest
    value (None without such a path)."""
    names = [name for name in names if name in paths]
    if not names:
        return None
    worst = 0.0
    paths["cublas+lora"]()
    expected = [c[1].clone() for c in paths["calls"]]
    for name in names:
        paths[name]()
        for out, call in zip(expected, paths["calls"]):
            worst = max(worst, bench_kernels.rel_err(call[1], out))
    return worst


def few(n: int, count: int) -> list[tuple[int | None, int]]:
    """n decodes spread over `count` adapters."""
    return [(i % count, 1) for i in range(n)]


def layer_cases(model: Model, n: int = 64) -> list[Callable[[], LoraCase]]:
    """Decode steps of few adapters and, to compare, of one adapter per request."""
    if n < 64:  # --smoke
        return [lambda: lora_case(f"decode {n} req, 2 adapters", model, adapters([8, 16]), few(n, 2))]
    return [
        lambda: lora_case(f"decode {n} req, 4 adapters r64", model, adapters([64] * 4), few(n, 4)),
        lambda: lora_case(f"S2 decode {n} req, 5 adapters", model, s2_adapters(5), few(n, 5)),
        lambda: lora_case(f"S1 decode {n} req, 5 adapters", model, [S1] * 5, few(n, 5)),
        lambda: lora_case("decode 128 req, 4 adapters r64", model, adapters([64] * 4), few(128, 4)),
        lambda: lora_case("decode 16 req, 4 adapters r64", model, adapters([64] * 4), few(16, 4)),
        lambda: lora_case(f"decode {n} req, {n} adapters r16", model, adapters([16] * n), [(i, 1) for i in range(n)]),
        lambda: lora_case(f"S2 decode {n} req, {n} adapters", model, s2_adapters(n), [(i, 1) for i in range(n)]),
    ]


def layer_bench(model: Model, copy_gbps: float, gen: torch.Generator, n: int = 64) -> list[dict[str, Any]]:
    """Part 2: each case's four paths, the LoRA's time over cuBLAS and its fraction of copy bandwidth."""
    w = weights(model, gen)
    results = []
    for make in layer_cases(model, n):
        case = make()
        nbytes = sum(lora_minimum(case, modules, k)[0] for _, modules, k, _ in projections(model))
        paths = layer_paths(case, w, gen)
        triton_err = check_against_engine(paths, ["triton+lora"])
        times = {name: timed_ms(fn) for name, fn in paths.items() if name != "calls"}
        entry: dict[str, Any] = {"case": case.name, "lora_min_bytes": nbytes, "triton_lora_rel_err": triton_err,
                                 "ms": times}  # fmt: skip
        for path in ("cublas+lora", "triton+lora"):
            ms, base = times[path], times["triton" if path == "triton+lora" else "cublas"]
            if ms is not None and base is not None:
                lora_ms = ms - base
                entry[f"{path} lora_ms"] = lora_ms
                entry[f"{path} lora_frac_copy"] = nbytes / (lora_ms / 1e3) / 1e9 / copy_gbps if lora_ms > 0 else None
        logger.info("%s: %s (triton+lora err %s)", case.name, {k: None if v is None else round(v, 4) for k, v in
                    times.items()}, triton_err)  # fmt: skip
        results.append(entry)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the results")
    parser.add_argument("--sweep", action="store_true", help="also part 1, the GEMM configs against cuBLAS (~3 min)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one call each (CPU: Triton interpreter)")
    parser.add_argument("--rows", type=int, nargs="+", help="part 1's row counts (default 1 16 64 128)")
    parser.add_argument("--skip-layer", action="store_true", help="part 1 only")
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a kernel field of EngineConfig (triton_gemm, lora_pdl, shrink_pdl, ...), e.g. "
                             "shrink_pdl=false")  # fmt: skip
    args = parser.parse_args(argv)
    bench_kernels.kernel_settings = bench_kernels.settings_of(args.engine_option, parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not torch.cuda.is_available():
        if not args.smoke:
            logger.error("bench_lora_gemm needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
            return 2
        bench_kernels.DEVICE = torch.device("cpu")
    global ROWS, CONFIGS
    if args.rows:
        ROWS = tuple(args.rows)
    model, n = LLAMA_7B, 64
    if args.smoke:
        model, n, CONFIGS = TINY_MHA, 4, SMOKE_CONFIGS
        ROWS = (1, 5)
    gen = torch.Generator(device=bench_kernels.DEVICE).manual_seed(0)
    device = measure_device(args.smoke)
    logger.info("%s: copy %.0f GB/s", device.name, device.copy_gbps)
    settings = bench_kernels.kernel_settings
    shrink_pdl = pdl.shrink_pdl(bench_kernels.DEVICE, settings)
    logger.info("LoRA shrink launched with PDL: %s (--engine-option shrink_pdl=false turns it off)", shrink_pdl)
    payload: dict[str, Any] = {"device": dataclasses.asdict(device), "shrink_pdl": shrink_pdl,
                               "settings": dataclasses.asdict(settings)}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload["gemm"] = gemm_sweep(model, device.copy_gbps, gen) if args.sweep else []
    args.out.write_text(json.dumps(payload, indent=1))
    payload["layer"] = [] if args.skip_layer else layer_bench(model, device.copy_gbps, gen, n)
    args.out.write_text(json.dumps(payload, indent=1))
    for entry in payload["layer"]:
        sys.stdout.write(json.dumps(entry) + "\n")
    logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
