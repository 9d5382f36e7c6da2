"""Host time of eager engine steps with the Triton kernels' launches stubbed out: the Python and launch-path work
of every layer (launch reuse, metadata, checks, views, torch ops on tiny tensors), on any machine.

On the H200 host eager steps are bound by this work (perf/RESULTS.md, "host time by phase": ~25 ms to launch an
eager decode step of ~100 sequences whose kernels take ~13 ms), and it cannot be measured there cheaply. Here each
Triton kernel is replaced by a stand-in that compiles nothing and launches nothing, so that what is timed is our
side of every launch; the torch ops (GEMMs) run on tiny CPU tensors. Use a model of 32 layers and tiny widths:

    python -m perf.make_model --shape tiny-deep --out /tmp/deep
    python -m perf.make_adapters --model /tmp/deep --setting S1 -n 128 --out /tmp/deep-adapters
    python -m perf.bench_host_forward --model /tmp/deep --adapter-root /tmp/deep-adapters --seqs 128
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from triton.compiler import CompiledKernel

from perf.bench_decode_step import adapter_dirs, start_prefilled
from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.engine.warmup import synthetic_prompt
from slora.kernels.triton.jit_stats import kernels_replaced
from slora.kernels.triton.ops import TritonOps

logger = logging.getLogger(__name__)


class StubCompiled(CompiledKernel):
    """A compiled kernel whose launches do nothing (no GPU, nothing compiled)."""

    def __init__(self) -> None:
        self.module = None  # what CompiledKernel.__del__ unloads

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args: None


class StubKernel:
    """Stands in for a @triton.jit function: same argument names, and a launch that returns a StubCompiled."""

    def __init__(self, kernel: Any) -> None:
        self.arg_names = list(kernel.arg_names)
        self.__name__ = kernel.__name__

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., StubCompiled]:
        return lambda *args, **kwargs: StubCompiled()


def stubbed_kernels() -> contextlib.AbstractContextManager[None]:
    """Every kernel of slora.kernels replaced by a StubKernel for the duration."""
    return kernels_replaced(StubKernel)


@dataclass(frozen=True)
class HostForward:
    kind: str  # "decode" or "mixed"
    seqs: int
    layers: int
    median_ms: float  # host time of a whole step
    per_layer_us: float  # the median step's time over the layers (the step's non-layer work included)
    repeats_ms: list[float]


def measure(engine: LLMEngine, steps: int, repeats: int, new_prompts: int, prompt_len: int) -> list[float]:
    """Mean ms per step of `repeats` runs of `steps` steps; with new_prompts > 0 every step also starts that many
    requests (mixed steps: their prompts and everyone's decodes)."""
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    vocab = engine.spec.vocab_size
    times = []
    for r in range(repeats):
        elapsed = 0.0
        for s in range(steps):
            for i in range(new_prompts):
                engine.add_request(synthetic_prompt(r * 10_000 + s * 100 + i, prompt_len, vocab), None, greedy)
            start = time.perf_counter()
            engine.step()
            elapsed += time.perf_counter() - start
        times.append(1000 * elapsed / steps)
    return times


def run(args: argparse.Namespace) -> list[HostForward]:
    # The stand-in kernels leave their outputs unwritten: garbage that may hold denormals, on which CPU matmuls
    # crawl (a GPU's do not).
    torch.set_flush_denormal(True)
    names = adapter_dirs(args.adapter_root, args.seqs) if args.adapter_root else []
    config = EngineConfig(model=args.model, load_format="dummy", device="cpu", kernel_backend="torch",
                          adapter_root=args.adapter_root, max_num_seqs=args.seqs + 64,
                          max_batch_tokens=4096)  # fmt: skip
    engine = LLMEngine(config)
    room = engine.max_model_len - args.prompt_len
    long_run = SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True)
    prompts = [synthetic_prompt(i, args.prompt_len, engine.spec.vocab_size) for i in range(args.seqs)]
    start_prefilled(engine, prompts, names, long_run, detokenize=False)  # real (torch) forwards
    engine.model.ops = TritonOps()
    layers = engine.spec.num_layers
    results = []
    with stubbed_kernels():
        for kind, new_prompts in (("decode", 0), ("mixed", args.new_prompts)):
            measure(engine, 3, 1, new_prompts, args.prompt_len)  # first launches go through the (stub) JIT
            times = measure(engine, args.steps, args.repeats, new_prompts, args.prompt_len)
            median = statistics.median(times)
            results.append(HostForward(kind, args.seqs, layers, median, 1000 * median / layers,
                                       [round(t, 3) for t in times]))  # fmt: skip
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model folder (tiny-deep: 32 layers; weights are random)")
    parser.add_argument("--adapter-root", help="adapter folders, one per sequence; without it the base model")
    parser.add_argument("--seqs", type=int, default=128, help="decoding sequences")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-prompts", type=int, default=2, help="requests started at each mixed step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[HostForward]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    results = run(args)
    for r in results:
        logger.info("%s steps, %d sequences, %d layers: median %.2f ms of host time (%.0f us per layer; runs %s)",
                    r.kind, r.seqs, r.layers, r.median_ms, r.per_layer_us, r.repeats_ms)  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return results


if __name__ == "__main__":
    main()
