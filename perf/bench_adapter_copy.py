"""GPU time of placing one adapter's pages into a 7B-sized pool: one index_copy_ over all layers against
backend.adapter_copier.copy_pages_by_layer (one per layer, on 8-byte words).

A pool of more than 2**31 elements makes PyTorch split the single index_copy_ into many 32-bit kernels; this
shows what that costs per adapter, on the copy stream beside every step that loads one.

    python -m perf.bench_adapter_copy --out adapter_copy.json
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from slora.backend.adapter_copier import copy_pages_by_layer

logger = logging.getLogger(__name__)

PAGE_ELEMS = 16 * 4096  # 16 tokens of one 7B layer's K (or V): a page of the S2 runs' pool


def device_ms(fn: Callable[[], object], device: torch.device, reps: int = 20) -> float:
    """Mean milliseconds of fn over `reps` runs after a warm one: GPU time on CUDA, wall time elsewhere (smoke)."""
    fn()
    if device.type != "cuda":
        start_s = time.perf_counter()
        fn()
        return (time.perf_counter() - start_s) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def whole_pool_copy(storage: torch.Tensor, page_index: torch.Tensor, image: torch.Tensor) -> None:
    """The copier's former way: one index_copy_ along the page axis of every layer at once."""
    storage.index_copy_(1, page_index, image)


def run(layers: int, pages: int, adapter_pages: list[int], device: torch.device) -> list[dict[str, object]]:
    storage = torch.zeros((layers, pages, PAGE_ELEMS), dtype=torch.bfloat16, device=device)
    rows = []
    for count in adapter_pages:
        page_index = torch.randperm(pages, device=device)[:count]
        image = torch.randn((layers, count, PAGE_ELEMS), device=device).to(torch.bfloat16)
        ways: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]] = {
            "whole_pool": whole_pool_copy,
            "by_layer": copy_pages_by_layer,
        }
        row: dict[str, object] = {"pages_per_layer": count, "adapter_mb": image.numel() * 2 / 1e6}
        for name, way in ways.items():
            row[f"{name}_ms"] = device_ms(functools.partial(way, storage, page_index, image), device)
        copy_pages_by_layer(storage, page_index, image)
        if not torch.equal(storage[:, page_index], image):
            raise AssertionError("copy_pages_by_layer did not place the image")
        logger.info("%d pages a layer (%.1f MB): whole pool %.3f ms, by layer %.3f ms", count, row["adapter_mb"],
                    row["whole_pool_ms"], row["by_layer_ms"])  # fmt: skip
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--pages", type=int, default=8192, help="pool pages per layer (8192: 2**34 elements)")
    parser.add_argument("--adapter-pages", type=int, nargs="+", default=[2, 8, 16], help="an adapter's pages a layer")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    rows = run(args.layers, args.pages, args.adapter_pages, torch.device(args.device))
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
