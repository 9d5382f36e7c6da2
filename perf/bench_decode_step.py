"""Time whole engine decode steps (schedule → forward → sample) against the time to read the weights once.

Issue 4's target: a Llama-2-7B-shaped decode step at batch 1 with CUDA graphs ≤ 1.25 × (weight bytes / measured
copy bandwidth). For each batch size, with and without CUDA graphs, with and without adapters, the engine is
filled with that many requests, prefilled, and then `--steps` decode steps are timed end to end (host work
included, since that is what graphs remove).

    python -m perf.bench_decode_step --model /tmp/slora-perf/model --load-format dummy \\
        --adapter-root /tmp/slora-perf/adapters/S1 --batch 1 8 64 --out decode_step.json

`--engine-option KEY=VALUE` sets any other EngineConfig field, e.g. the kernels' `triton_gemm=false` (cuBLAS
projections), `shrink_pdl=false` or `few_adapters_min_tokens=64`.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from perf.step_profiler import StepProfiler
from slora.backend.config import EngineConfig, parse_size
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PROMPT_TOKENS = 128
WARM_STEPS = 3  # untimed decode steps before the clock starts


@dataclass(frozen=True)
class StepTiming:
    batch: int
    cuda_graphs: bool
    adapters: int  # distinct adapters of the batch (0: the base model)
    step_ms: float
    weight_read_ms: float
    weight_bytes: int = 0
    kv_bytes: int = 0  # K/V of every sequence at the middle of the timed steps
    adapter_bytes: int = 0  # pages of the batch's distinct adapters
    step_median_ms: float = 0.0

    @property
    def ratio(self) -> float:
        return self.step_ms / self.weight_read_ms

    @property
    def bandwidth_gbs(self) -> float:
        """The step's minimum bytes over its time."""
        return (self.weight_bytes + self.kv_bytes + self.adapter_bytes) / self.step_ms / 1e6


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), or of a host copy on CPU."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    _sync(device)
    return 2 * src.numel() * src.element_size() * 5 / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_decode(
    engine: LLMEngine,
    batch: int,
    adapters: list[str],
    steps: int,
    prompt_len: int = PROMPT_TOKENS,
    profiler: StepProfiler | None = None,
) -> tuple[float, float]:
    """(mean, median) milliseconds per decode step with `batch` running requests of prompt_len tokens (all
    prefilled first); then, outside the clock, the profiler's steps (device kernels, host functions).

    The median is of each step's wall time (the host runs at most one step ahead of the device, so it follows the
    device): a step that captures a graph or compiles a kernel moves the mean, not the median."""
    extra = profiler.total_steps if profiler is not None else 0
    params = SamplingParams(max_tokens=steps + extra + WARM_STEPS + 8, temperature=0.0, ignore_eos=True)
    prompt = [(7 * i) % engine.spec.vocab_size for i in range(prompt_len)]
    ids = start_prefilled(engine, [prompt] * batch, adapters, params, detokenize=True)
    for _ in range(WARM_STEPS):  # a step with a new graph key captures, a new kernel variant compiles
        engine.step()
    _sync(engine.device)
    start = time.perf_counter()
    ends = []
    for _ in range(steps):
        engine.step()
        ends.append(time.perf_counter())
    _sync(engine.device)
    elapsed = (time.perf_counter() - start) / steps
    median = statistics.median(b - a for a, b in zip([start, *ends], ends))
    for _ in range(extra):
        assert profiler is not None
        profiler.before_step()
        engine.step()
        profiler.after_step()
    for request_id in ids:
        engine.abort(request_id)
    return elapsed * 1000, median * 1000


def start_prefilled(
    engine: LLMEngine, prompts: list[list[int]], adapters: list[str], params: SamplingParams, detokenize: bool
) -> list[str]:
    """Add one request per prompt (adapters cycled; the base model when there are none) and step the engine until
    every prompt is computed, so that the next steps only decode. Returns the request ids."""
    ids = [
        engine.add_request(p, adapters[i % len(adapters)] if adapters else None, params, detokenize=detokenize)
        for i, p in enumerate(prompts)
    ]
    while any(r.num_computed < r.num_prompt for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    return ids


def adapter_dirs(root: str, count: int) -> list[str]:
    """The first `count` adapter directories under `root` (distinct adapters for the requests of a batch)."""
    names = sorted(
        p.name for p in Path(root).iterdir() if not p.name.startswith(".") and (p / "adapter_config.json").is_file()
    )
    return names[:count]


def batch_adapters(names: list[str], count: int, batch: int) -> list[str]:
    """The distinct adapters of a batch's requests (cycled over them): none (count 0), one per request (-1) or the
    first `count` of `names` (distinct directory names)."""
    return names[: batch if count < 0 else min(count, batch)]


def kv_bytes(engine: LLMEngine, batch: int, context: int) -> int:
    """K and V of `batch` sequences of `context` tokens, every layer."""
    spec = engine.spec
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * engine.model.weights.embed.element_size()
    return batch * context * per_token


def graph_modes(device: str, graphs_only: bool) -> tuple[bool, ...]:
    """Whether each engine runs with CUDA graphs: eager then graphs on a GPU (graphs alone if asked), eager on CPU."""
    if device == "cpu":
        return (False,)
    return (True,) if graphs_only else (False, True)


def engine_options(items: list[str]) -> dict[str, str]:
    """--engine-option KEY=VALUE items as EngineConfig.from_dict values."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-option expects KEY=VALUE, got {item!r}")
        options[key.strip()] = value.strip()
    return options


def run(args: argparse.Namespace) -> list[StepTiming]:
    timings: list[StepTiming] = []
    adapter_names = adapter_dirs(args.adapter_root, max(args.batch)) if args.adapter_root else []
    options = engine_options(getattr(args, "engine_option", None) or [])
    for graphs in graph_modes(args.device, args.graphs_only):
        values = {"model": args.model, "load_format": args.load_format, "device": args.device,
                  "adapter_root": args.adapter_root, "cuda_graphs": graphs, "max_num_seqs": max(args.batch),
                  "kernel_backend": args.kernel_backend, "pool_bytes": args.pool_bytes}  # fmt: skip
        config = EngineConfig.from_dict({**values, **options})
        logger.info("kernel settings: %s", config.kernel_settings())
        engine = LLMEngine(config)
        weight_bytes = engine.model.weights.nbytes()
        read_ms = weight_bytes / copy_bandwidth(engine.device) * 2 * 1000  # a read is half a copy
        for batch in args.batch:
            for count in args.adapter_counts if adapter_names else [0]:
                names = batch_adapters(adapter_names, count, batch)
                title = f"batch {batch} graphs {graphs} adapters {len(names)}"
                profiler = StepProfiler(0, args.profile_steps, args.profile, title) if args.profile else None
                step_ms, median_ms = time_decode(engine, batch, names, args.steps, args.prompt_len, profiler)
                nbytes = sum(engine.store.get(name).nbytes for name in names)
                context = args.prompt_len + args.steps // 2 + 1
                timing = StepTiming(batch, graphs, len(names), step_ms, read_ms, weight_bytes,
                                    kv_bytes(engine, batch, context), nbytes, median_ms)  # fmt: skip
                logger.info("batch %3d graphs %-5s adapters %4d: %.2f ms/step (median %.2f), %.2f x the weight read "
                            "(%.2f ms), %.0f GB/s on %.2f GB (adapters %.2f GB)", batch, graphs, timing.adapters,
                            step_ms, median_ms,
                            timing.ratio, read_ms, timing.bandwidth_gbs,
                            (weight_bytes + timing.kv_bytes + nbytes) / 1e9, nbytes / 1e9)  # fmt: skip
                timings.append(timing)
        del engine
        if args.device != "cpu":
            torch.cuda.empty_cache()
    return timings


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="safetensors")
    parser.add_argument("--adapter-root")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kernel-backend", default="auto")
    parser.add_argument("--pool-bytes", type=parse_size, default=None)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--adapter-counts", type=int, nargs="+", default=[0, -1],
                        help="adapters per batch: 0 none, -1 one per request, k: k shared round robin")  # fmt: skip
    parser.add_argument("--graphs-only", action="store_true", help="time the engine with CUDA graphs only")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--profile", type=Path, help="append torch.profiler and cProfile tables of a few steps here")
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                        help="any other EngineConfig field, e.g. triton_gemm=false (repeatable)")  # fmt: skip
    args = parser.parse_args()
    timings = run(args)
    if args.out:
        rows = [{**asdict(t), "ratio": t.ratio, "bandwidth_gbs": t.bandwidth_gbs} for t in timings]
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
