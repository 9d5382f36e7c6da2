"""Tenant isolation, in process: a noisy neighbour under each policy, and overload with and without early abort.

    python -m perf.bench_tenants --smoke --out /tmp/tenants.json      # tiny random model on CPU, about a minute
    python -m perf.bench_tenants --model /tmp/slora-perf/model --adapter-root /tmp/slora-perf/adapters/S1 \\
        --load-format dummy --device cuda --kernel-backend triton --engine-opt cuda_graphs=true --out results.json

The suites, their traces and what they measure are perf/tenant_suites.py's (the same as served through Triton,
perf/bench_tenants_served.py); here each tenant is one adapter (its default tenant: tenants.py) and the traces
are replayed in real time by bench_engine's Replay, one LLMEngine per configuration (fcfs, fair, early abort).
Every replay is a run in the results file (kind "engine", group "tenants"), with `tenants` (per-tenant figures),
`service_gap`, `slo` and `refusals` (the engine's counts by reason) in its metrics; a noisy run's `vs_without`
holds its comparison with the quiet run, an overload run's `load` and `goodput_over_capacity` its place in the
table.
"""

from __future__ import annotations

import argparse
import gc
import logging
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from perf.bench_engine import Replay, ReplayOptions, engine_config, preload_adapters, warm_up
from perf.results import headline, make_run, trace_info
from perf.tenant_measures import service_gap, slo_figures, steady_rate, tenant_figures
from perf.tenant_suites import (
    MODES,
    REASONS,
    SMOKE,
    BenchOptions,
    Replayed,
    add_plan_arguments,
    burst_trace,
    plan_from_args,
    run_suites,
    tenant_metrics,
    tenant_trace,
)
from perf.workload import Trace
from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine

# The shared plan and measures, under the names this module has always offered (tests, notebooks).
__all__ = ["MODES", "SMOKE", "Bench", "BenchOptions", "main", "run", "service_gap", "slo_figures", "steady_rate",
           "tenant_figures", "tenant_trace"]  # fmt: skip

logger = logging.getLogger(__name__)


# ---- running -----------------------------------------------------------------------------------------------------


class _ProgressReplay(Replay):
    """bench_engine's replay with a progress bar of finished (or refused) requests."""

    def __init__(self, engine: LLMEngine, trace: Trace, options: ReplayOptions, bar: tqdm) -> None:
        super().__init__(engine, trace, options)
        self.bar = bar

    def _step(self) -> float | None:
        finished = super()._step()
        done = len(self.records) - len(self.open) - len(self.pending)
        self.bar.update(done - self.bar.n)
        return finished


class Bench:
    """The suites' TenantBench in process: one engine per EngineConfig variant (policy, SLO), kept for all the
    runs that use it."""

    prefix = "tenants"

    def __init__(self, base: EngineConfig, options: BenchOptions, adapters: list[str]) -> None:
        self.base = base
        self.options = options
        self.adapters = adapters
        self.replay_options = ReplayOptions(
            time_limit_s=options.time_limit_s, warmup_requests=options.warmup_requests, progress_interval_s=30.0
        )
        self._engines: dict[str, LLMEngine] = {}
        self.vocab_size = 0

    def engine(self, changes: dict[str, Any]) -> LLMEngine:
        key = repr(sorted(changes.items()))
        if key not in self._engines:
            self._engines.clear()  # one engine at a time: they share the device
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the next engine sizes its pool from the memory left free
            config = replace(self.base, **changes)
            started = time.perf_counter()
            engine = LLMEngine(config)
            preload_adapters(engine, self.adapters, None)
            engine.capture_graphs_for_host_adapters()
            self.vocab_size = engine.spec.vocab_size
            warm_up(engine, burst_trace(self.adapters, self.options, 99, self.vocab_size), self.replay_options)
            logger.info("engine %s ready in %.1fs", changes, time.perf_counter() - started)
            self._engines[key] = engine
        return self._engines[key]

    def prepare(self, changes: dict[str, Any]) -> None:
        self.engine(changes)

    def replay(self, name: str, trace: Trace, changes: dict[str, Any], window_s: float | None = None) -> Replayed:
        """Replay `trace` on the engine of `changes`; per-tenant throughput over [0, window_s] (default: the run)."""
        engine = self.engine(changes)
        engine.evict_adapters()
        before = engine.stats()
        with tqdm(total=len(trace), desc=name, unit="req", disable=not self.options.progress, leave=False) as bar:
            replay = _ProgressReplay(engine, trace, self.replay_options, bar)
            duration = replay.run()
        records = list(replay.records.values())
        costs = (engine.config.fair_prompt_cost, engine.config.fair_output_cost)
        metrics = tenant_metrics(records, duration, window_s or duration, self.options, costs)
        metrics["refusals"] = {k: getattr(engine.stats(), f"refused_{k}") - getattr(before, f"refused_{k}")
                               for k in REASONS}  # fmt: skip
        options = {**asdict(self.options), "mode": "lora", "engine_changes": changes, "engine": asdict(engine.config)}
        run = make_run(name, "engine", trace_info(trace), options, metrics, group="tenants")
        logger.info("%s | service gap %.0f | slo %s", headline(run), metrics["service_gap"], metrics["slo"])
        return Replayed(name, trace, records, duration, run)


def run(base: EngineConfig, options: BenchOptions, adapters: list[str], out: Path, suites: tuple[str, ...]) -> None:
    """Capacity, then per engine configuration (fcfs, fair, early abort: one engine each) its runs."""
    run_suites(Bench(base, options, adapters), out, suites)


# ---- command line ------------------------------------------------------------------------------------------------


def smoke_model(root: Path, tenants: int) -> tuple[Path, Path, list[str]]:
    """perf's tiny random model and S1 adapters (tenants + 1 of them) under `root`."""
    from perf.make_adapters import SETTINGS, make_adapters
    from perf.make_model import SHAPES, write_model_dir

    model = write_model_dir(SHAPES["tiny"], root / "model")
    names = make_adapters(model, SETTINGS["S1"], n=tenants + 1, out=root / "adapters", distinct=2)
    return model, root / "adapters", names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny random model on CPU, short runs (SMOKE)")
    parser.add_argument("--model", type=Path, help="model directory (not with --smoke)")
    parser.add_argument("--adapter-root", type=Path, help="adapters named <prefix><index:04d>, tenants + 1 of them")
    parser.add_argument("--adapter-prefix", default="s1-")
    parser.add_argument("--load-format", default="dummy", choices=("dummy", "safetensors"))
    parser.add_argument("--kernel-backend", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--host-budget", help="host memory for adapters, e.g. 64GiB")
    parser.add_argument("--engine-opt", action="append", default=[], help="any EngineConfig field, KEY=VALUE")
    add_plan_arguments(parser)
    args = parser.parse_args(argv)
    if not args.smoke and (args.model is None or args.adapter_root is None):
        parser.error("--model and --adapter-root are needed without --smoke")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    options, suites = plan_from_args(args)
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="slora-tenants-") as tmp:
            model, adapter_root, names = smoke_model(Path(tmp), options.tenants)
            args.model, args.adapter_root, args.device = model, adapter_root, "cpu"
            run(engine_config(args), options, names, args.out, suites)
        return
    names = [f"{args.adapter_prefix}{i:04d}" for i in range(options.tenants + 1)]
    run(engine_config(args), options, names, args.out, suites)


if __name__ == "__main__":
    main()
