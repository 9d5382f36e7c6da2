"""A trace's adapter churn without a GPU: the engine's own scheduler, adapter cache and copier replay it on CPU, with
the forward stubbed, a modelled clock and modelled copy times. It counts what a served run's metrics count (adapter
copies into the pool, evictions from it, preemptions) and shows how engine options change them.

Served runs are where these counts come from, but the GPU host is lent rarely, and a served run's metrics do not say
which engine option causes the churn they show (perf/RESULTS.md, session 48). Here each step advances the clock by the
served run's mean decode-step or prompt-step time, requests are added once the clock passes their arrival, and the
copier's thread sleeps for each copy in proportion to its pages. The model keeps the trace shape's ratio of adapter
pages to KV pages at CPU widths (an adapter of rank r takes the pages it takes on the full model), and the pool has the
served engine's page count.

    python -m perf.pool_churn --trace sall-n250.jsonl --setting Sall --pool-pages 7111 --copy-ms 20 \\
        --engine-option max_num_seqs=208 --out churn.json

What it does not model: the GPU time copies and LoRA take, and the host time of a step (a step's host work here runs
on this machine's clock, while the modelled clock advances by the served run's step times).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from perf.bench_decode_step import engine_options
from perf.bench_host_step import stub_forward
from perf.make_adapters import SETTINGS, make_adapters
from perf.make_model import SHAPES, ModelShape, write_model_dir
from perf.workload import Trace, TraceRequest, load_trace
from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.memory.adapter_copier import AdapterCopier
from slora.backend.memory.page_pool import PoolGeometry
from slora.backend.model.spec import ModelSpec

logger = logging.getLogger(__name__)

# The served engine's options on the H100 host for Llama-2-7B (server.log of perf/RESULTS.md's session 48), where
# they differ from a CPU engine's own defaults.
SERVED_OPTIONS = {"max_num_seqs": "208", "max_batch_tokens": "2048", "admit_interval": "2", "overlap_steps": "true",
                  "admit_when_copied": "true", "max_bypass": "8"}  # fmt: skip
MEAN_ADAPTER_PAGES = 19.25  # an S-all adapter of Llama-2-7B at ranks 64/32/16/8, on average: --copy-ms is for this


@dataclass
class Churn:
    requests: int  # of the trace, added by the end
    finished: int
    steps: int
    clock_s: float  # the modelled clock at the end
    adapter_loads: int
    adapter_evictions: int
    preemptions: int
    resident_at_end: int  # adapters in the pool at the end
    options: dict[str, str]
    wall_s: float

    @property
    def loads_per_request(self) -> float:
        return self.adapter_loads / max(self.requests, 1)


def cpu_shape(shape: ModelShape) -> ModelShape:
    """`shape` at CPU widths (ModelShape.tiny), its intermediate size scaled with the hidden size, so that an adapter
    on all seven projections takes as many pages, against KV, as on the full model."""
    tiny = shape.tiny()
    return replace(tiny, intermediate_size=round(tiny.hidden_size * shape.intermediate_size / shape.hidden_size))


def prepare(work: Path, shape: str, setting: str, adapters: int) -> tuple[Path, Path]:
    """The CPU model of `shape` and `adapters` adapters of `setting` under `work`, each made once."""
    model, root = work / shape / "model", work / shape / f"{setting}-{adapters}"
    if not (model / "config.json").is_file():
        write_model_dir(cpu_shape(SHAPES[shape]), model)
    if not root.is_dir():
        make_adapters(model, SETTINGS[setting], adapters, root, progress=False)
    return model, root


def build_engine(model: Path, root: Path, pool_pages: int, options: dict[str, str]) -> LLMEngine:
    """A CPU engine over `model` with a pool of `pool_pages` pages, the forward stubbed."""
    values: dict[str, Any] = {"model": str(model), "load_format": "dummy", "device": "cpu", "kernel_backend": "torch",
                              "adapter_root": str(root), "warmup": False, "page_size": 16, **options}  # fmt: skip
    config, spec = EngineConfig.from_dict(values), ModelSpec.from_dir(model)
    geometry = PoolGeometry(spec.num_layers, config.page_size, spec.num_kv_heads, spec.head_dim)
    page_bytes = geometry.page_bytes(config.torch_dtype(torch.device("cpu")))
    engine = LLMEngine(EngineConfig.from_dict({**values, "pool_bytes": str(pool_pages * page_bytes)}))
    if engine.pool.num_pages != pool_pages:
        raise ValueError(f"the pool has {engine.pool.num_pages} pages, not the {pool_pages} asked for")
    engine.store.preload()
    stub_forward(engine)
    return engine


def slow_copies(copier: AdapterCopier, ms_per_mean_adapter: float) -> None:
    """Make each copy take `ms_per_mean_adapter` for an adapter of MEAN_ADAPTER_PAGES pages, in proportion, on the
    copier's thread (where the served engine's staging and transfer run)."""
    copy = copier._copy

    def timed(image: torch.Tensor, page_index: torch.Tensor, *rest: Any) -> Any:
        time.sleep(ms_per_mean_adapter / 1000 * len(page_index) / MEAN_ADAPTER_PAGES)
        return copy(image, page_index, *rest)

    copier._copy = timed


def replay(
    engine: LLMEngine, trace: Trace, decode_ms: float, prompt_ms: float, limit_s: float
) -> tuple[int, int, int, float]:
    """Replay `trace` on the modelled clock until it is done or the clock passes `limit_s`; (requests added,
    requests finished, steps, clock)."""
    pending: list[TraceRequest] = list(trace.requests)
    added, finished, steps, clock = 0, 0, 0, 0.0
    while clock < limit_s and (added < len(pending) or engine.has_unfinished()):
        while added < len(pending) and pending[added].arrival <= clock:
            request = pending[added]
            sampling = SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
            engine.add_request(list(request.prompt_ids), request.adapter, sampling, detokenize=False)
            added += 1
        if not engine.has_unfinished():
            clock = pending[added].arrival  # idle until the next arrival
            continue
        prompt_steps = engine.scheduler.step_totals.kinds["prompt"]
        prompts_before = prompt_steps.steps
        finished += sum(1 for output in engine.step() if output.finished)
        clock += (prompt_ms if prompt_steps.steps > prompts_before else decode_ms) / 1000
        steps += 1
    return added, finished, steps, clock


def run(args: argparse.Namespace) -> Churn:
    trace = load_trace(args.trace)
    prefix, named = SETTINGS[args.setting].prefix, trace.config.adapter_prefix
    if trace.config.num_adapters and named != prefix:
        raise ValueError(f"--trace names adapters {named}*, --setting {args.setting} makes {prefix}*")
    model, root = prepare(args.work, args.shape, args.setting, max(trace.config.num_adapters, 1))
    options = {**SERVED_OPTIONS, **engine_options(args.engine_option)}
    engine = build_engine(model, root, args.pool_pages, options)
    if args.copy_ms:
        slow_copies(engine.cache.copier, args.copy_ms)
    start = time.perf_counter()
    added, finished, steps, clock = replay(engine, trace, args.decode_ms, args.prompt_ms, args.limit_s)
    stats = engine.stats()
    churn = Churn(added, finished, steps, round(clock, 3), stats.adapter_loads, stats.adapter_evictions,
                  stats.preemptions, len(engine.cache), options, round(time.perf_counter() - start, 1))  # fmt: skip
    return churn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, required=True, help="a perf.workload trace (vocabulary of at most 1024)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b", help="the served model's shape")
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="Sall", help="the trace's adapters")
    parser.add_argument("--work", type=Path, default=Path("/tmp/slora-perf/pool-churn"), help="model and adapters")
    parser.add_argument("--pool-pages", type=int, default=7111, help="the served engine's pool (its start-up log)")
    parser.add_argument("--decode-ms", type=float, default=26.9, help="a decode step on the modelled clock")
    parser.add_argument("--prompt-ms", type=float, default=45.9, help="a step with prompts on the modelled clock")
    parser.add_argument(
        "--copy-ms",
        type=float,
        default=0.0,
        help=f"a copy of {MEAN_ADAPTER_PAGES} pages into the pool (0: as fast as this machine)",
    )
    parser.add_argument("--limit-s", type=float, default=120.0, help="stop when the modelled clock passes this")
    parser.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an EngineConfig field, over SERVED_OPTIONS",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.pool_pages < 1 or args.decode_ms <= 0 or args.prompt_ms <= 0 or args.copy_ms < 0 or args.limit_s <= 0:
        parser.error("--pool-pages, --decode-ms, --prompt-ms and --limit-s must be positive, --copy-ms >= 0")
    return args


def main(argv: list[str] | None = None) -> Churn:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("slora").setLevel(logging.WARNING)
    args = parse_args(argv)
    churn = run(args)
    result = {**asdict(churn), "loads_per_request": round(churn.loads_per_request, 3)}
    logger.info("%s", json.dumps(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return churn


if __name__ == "__main__":
    main()
