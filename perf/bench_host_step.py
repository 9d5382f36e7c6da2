"""Host time of an engine decode step: everything but the forward (scheduling, batch and metadata building,
sampling, token bookkeeping), with the model's forward replaced by one that returns zero logits.

On the GPU this host work runs between CUDA-graph replays while the GPU idles (about 7 ms of a 27 ms S1 decode
step of ~208 requests in perf/RESULTS.md), so it is worth measuring on its own, on any machine:

    python -m perf.bench_host_step --model /tmp/slora-perf/model --adapter-root /tmp/slora-perf/adapters/S1 \\
        --seqs 256 --prompt-len 300 --out host_step.json

With --join K, K new requests (prompts of --join-prompt-len tokens, one output token) join before every step: the
host time of mixed steps, whose new adapters are loaded and whose LoRA tables are rebuilt every step. Adapters are
read into host memory first, as a server's preload does.

The steps run with the garbage collector as a server sets it (start-up objects frozen, young collections made rare:
backend/runtime/gc_threshold.py); --python-gc-defaults runs them with CPython's thresholds instead. The collections'
milliseconds per step are reported with the step time.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from perf.bench_decode_step import adapter_dirs, start_prefilled
from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.engine.warmup import synthetic_prompt
from slora.backend.executor.batch import ForwardBatch
from slora.backend.memory.page_pool import PagePool
from slora.backend.runtime.gc_freeze import startup_objects_frozen
from slora.backend.runtime.gc_pauses import GENERATIONS, PROCESS
from slora.backend.runtime.gc_threshold import young_threshold_raised

logger = logging.getLogger(__name__)

VOCAB = 1024  # width of the stand-in logits (sampling cost grows with it; the model's vocab is not needed)


@dataclass(frozen=True)
class HostStep:
    seqs: int
    adapters: int
    median_ms: float
    repeats_ms: list[float]
    joins: int = 0  # new requests per step (Joiners); 0: decode steps only
    gc_ms: float = 0.0  # garbage collections' pause per step, over every measured step
    python_gc_defaults: bool = False  # CPython's collector thresholds instead of the server's


def fill(engine: LLMEngine, seqs: int, prompt_len: int, adapter_names: list[str]) -> None:
    """`seqs` requests (adapters cycled; none when the list is empty), prefilled with the real forward."""
    room = engine.max_model_len - prompt_len
    if room < 2:
        raise ValueError(f"prompt_len {prompt_len} leaves no room to decode in the model's {engine.max_model_len}")
    greedy = SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True)
    prompts = [synthetic_prompt(i, prompt_len, engine.spec.vocab_size) for i in range(seqs)]
    start_prefilled(engine, prompts, adapter_names, greedy, detokenize=False)


def stub_forward(engine: LLMEngine) -> None:
    def forward(batch: ForwardBatch, pool: PagePool) -> torch.Tensor:
        return torch.zeros((len(batch.sampled), VOCAB), device=pool.storage.device)

    engine.runner.model.forward = forward  # type: ignore[method-assign]
    engine.runner.graphs = None


class Joiners:
    """Before each step, `count` new requests with prompts of `prompt_len` tokens and one output token each, so that
    every step is a mixed one (the running decodes plus these prompts) while the batch keeps its size. Their
    adapters continue the cycle through the list after the running requests' (new adapters to load, as at n = 2000)."""

    def __init__(self, engine: LLMEngine, count: int, prompt_len: int, adapter_names: list[str], first: int) -> None:
        self._engine, self._count, self._prompt_len = engine, count, prompt_len
        self._names, self._next = adapter_names, first
        self._params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def __call__(self) -> None:
        for _ in range(self._count):
            i, self._next = self._next, self._next + 1
            prompt = synthetic_prompt(i, self._prompt_len, self._engine.spec.vocab_size)
            adapter = self._names[i % len(self._names)] if self._names else None
            self._engine.add_request(prompt, adapter, self._params, detokenize=False)


def measure(engine: LLMEngine, steps: int, repeats: int, joiners: Joiners | None = None) -> list[float]:
    """Milliseconds per step of `repeats` runs of `steps` steps each (joiners, if any, added before each step)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            if joiners is not None:
                joiners()
            engine.step()
        times.append(1000 * (time.perf_counter() - start) / steps)
    return times


def run(args: argparse.Namespace) -> HostStep:
    root = Path(args.adapter_root) if args.adapter_root else None
    joining = args.join * (args.join_prompt_len + 1)  # each step's new prompts, and their finishing tokens
    config = EngineConfig(model=args.model, load_format="dummy", device=args.device, kernel_backend="torch",
                          adapter_root=str(root) if root else None, max_num_seqs=args.seqs + 2 * args.join,
                          max_batch_tokens=max(2048, args.seqs + joining))  # fmt: skip
    engine = LLMEngine(config)
    names = adapter_dirs(str(root), args.adapters) if root else []
    if names:
        engine.store.preload(names=names)
    fill(engine, args.seqs, args.prompt_len, names[: args.seqs])
    stub_forward(engine)
    joiners = Joiners(engine, args.join, args.join_prompt_len, names, args.seqs) if args.join else None
    measure(engine, args.steps, 1, joiners)  # warm
    with collector_as(args.python_gc_defaults):
        before = PROCESS.as_stats()
        times = measure(engine, args.steps, args.repeats, joiners)
        after = PROCESS.as_stats()
    gc_s = sum(after[f"gc_seconds_{g}"] - before[f"gc_seconds_{g}"] for g in GENERATIONS)
    return HostStep(args.seqs, len(names), statistics.median(times), [round(t, 3) for t in times], args.join,
                    round(1000 * gc_s / (args.steps * args.repeats), 3), args.python_gc_defaults)  # fmt: skip


@contextmanager
def collector_as(python_defaults: bool) -> Iterator[None]:
    """The garbage collector as a serving process sets it, or with CPython's thresholds (start-up objects frozen
    either way)."""
    with startup_objects_frozen(), nullcontext() if python_defaults else young_threshold_raised():
        yield


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model folder (weights are random: load_format=dummy)")
    parser.add_argument("--adapter-root", help="adapter folders; without it the requests use the base model")
    parser.add_argument("--adapters", type=int, default=1 << 30, help="use at most this many of them")
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument(
        "--join",
        type=int,
        default=0,
        help="new requests before each step (prompts of --join-prompt-len, one output token): mixed steps",
    )
    parser.add_argument("--join-prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--python-gc-defaults", action="store_true",
                        help="CPython's collector thresholds, not the server's (gc_threshold.py)")  # fmt: skip
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> HostStep:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    result = run(args)
    logger.info("host-only step, %d sequences + %d new each step, %d adapters, %s collector: median %.2f ms (runs %s), "
                "of it garbage collections %.2f ms a step", result.seqs, result.joins, result.adapters,
                "CPython's" if result.python_gc_defaults else "the server's", result.median_ms, result.repeats_ms,
                result.gc_ms)  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(asdict(result), indent=1))
    return result


if __name__ == "__main__":
    main()
