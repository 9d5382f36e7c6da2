"""Tenant isolation, in process: a noisy neighbour under each policy, and overload with and without early abort.

    python -m perf.bench_tenants --smoke --out /tmp/tenants.json      # tiny random model on CPU, about a minute
    python -m perf.bench_tenants --model /tmp/slora-perf/model --adapter-root /tmp/slora-perf/adapters/S1 \\
        --load-format dummy --device cuda --kernel-backend triton --engine-opt cuda_graphs=true --out results.json

Each tenant is one adapter (its default tenant: tenants.py); requests have S-LoRA's uniform lengths and Poisson
arrivals, replayed in real time by bench_engine's Replay. What runs, in order:

- capacity: `capacity_requests` requests offered at once under fcfs: completions per second while the batch is
  full (between the 10th and 80th percentiles of the finish times), C.
- noisy neighbour, per policy in `policies`: `tenants` tenants at equal rates summing to base_load × C, once with
  one more tenant at noisy_factor times a tenant's rate and once without it. For each well-behaved tenant: its
  throughput (output tokens per second while requests arrive) with the noisy tenant over without, its first-token
  p90 with over without;
  and the largest service difference between two tenants backlogged over a whole window (VTC's measure).
- overload at each of `loads` × C, per mode: fcfs, fair, early abort (fcfs with EngineConfig.ttft_slo_s = slo_s):
  SLO attainment of all offered requests (a refused one misses), of the admitted ones, and goodput (requests that
  met the SLO per second of the run).

Service is counted in the fair policy's cost: fair_prompt_cost per prompt token when the first token comes,
fair_output_cost per output token as it streams. A tenant is backlogged from a request's arrival to its first token.
Every replay is a run in the results file (kind "engine", group "tenants"), with `tenants` (per-tenant figures),
`service_gap` and `slo` in its metrics; a noisy run's `vs_without` holds its comparison with the quiet run, an
overload run's `load` and `goodput_over_capacity` its place in the table.
"""

from __future__ import annotations

import argparse
import gc
import logging
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from perf.bench_engine import Replay, ReplayOptions, engine_config, preload_adapters, warm_up
from perf.metrics import RequestRecord, summarize
from perf.results import append_runs, headline, make_run, trace_info
from perf.workload import Trace, TraceConfig, TraceRequest
from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

REASONS = ("ttft_slo", "ttft_slo_early", "queue_timeout")  # EngineStats.refused_<reason>
MODES: dict[str, dict[str, Any]] = {  # overload modes: EngineConfig changes
    "fcfs": {"scheduling_policy": "fcfs"},
    "fair": {"scheduling_policy": "fair"},
    "early-abort": {"scheduling_policy": "fcfs", "early_abort": True},  # + ttft_slo_s
}


@dataclass(frozen=True)
class BenchOptions:
    tenants: int = 20
    noisy_factor: float = 10.0
    base_load: float = 0.8  # the well-behaved tenants together, in units of capacity
    policies: tuple[str, ...] = ("fcfs", "fair")
    loads: tuple[float, ...] = (1.0, 1.5, 2.0, 4.0)
    modes: tuple[str, ...] = tuple(MODES)
    duration_s: float = 60.0  # of arrivals, per run
    capacity_requests: int = 512
    input_range: tuple[int, int] = (8, 512)
    output_range: tuple[int, int] = (8, 512)
    slo_s: float = 6.0
    gap_window: float = 0.1  # service-gap windows, as a fraction of the run
    time_limit_s: float = 600.0
    warmup_requests: tuple[int, ...] = (8, 64, 256)
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.tenants < 2:
            raise ValueError(f"tenants must be >= 2, got {self.tenants}")
        for name in ("noisy_factor", "base_load", "duration_s", "slo_s", "time_limit_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 < self.gap_window <= 1:
            raise ValueError(f"gap_window must be in (0, 1], got {self.gap_window}")
        if any(load <= 0 for load in self.loads):
            raise ValueError(f"loads must be > 0, got {self.loads}")
        for mode in self.modes:
            if mode not in MODES:
                raise ValueError(f"modes must be among {', '.join(MODES)}, got {mode!r}")
        if self.capacity_requests < 1:
            raise ValueError(f"capacity_requests must be >= 1, got {self.capacity_requests}")

    @property
    def noisy_tenant(self) -> int:
        return self.tenants  # adapter index of the noisy tenant: the one after the well-behaved ones


SMOKE = BenchOptions(tenants=4, duration_s=1.0, capacity_requests=48, input_range=(4, 24), output_range=(4, 24),
                     slo_s=0.5, time_limit_s=30.0, warmup_requests=(4,), loads=(1.0, 2.0, 4.0))  # fmt: skip


# ---- traces ----------------------------------------------------------------------------------------------------


def tenant_trace(rates: dict[str, float], options: BenchOptions, seed: int, vocab_size: int) -> Trace:
    """Poisson arrivals per tenant at its rate over duration_s, merged; uniform lengths; random token ids. Each
    tenant draws from its own generator, so a tenant's requests are the same whoever else is in the trace."""
    drawn: list[tuple[float, str, tuple[int, ...], int]] = []
    for k, (adapter, rate) in enumerate(rates.items()):
        rng = np.random.default_rng([seed, k])
        t = rng.exponential(1.0 / rate)
        while t < options.duration_s:
            drawn.append((t, adapter, *_lengths(rng, options, vocab_size)))
            t += rng.exponential(1.0 / rate)
    drawn.sort(key=lambda d: d[0])
    return _trace(drawn, options, sum(rates.values()), len(rates))


def burst_trace(adapters: list[str], options: BenchOptions, seed: int, vocab_size: int) -> Trace:
    """capacity_requests requests at time 0, round robin over the adapters."""
    rng = np.random.default_rng(seed)
    drawn = [(0.0, adapters[i % len(adapters)], *_lengths(rng, options, vocab_size))
             for i in range(options.capacity_requests)]  # fmt: skip
    return _trace(drawn, options, float(len(drawn)), len(adapters))


def _lengths(rng: np.random.Generator, options: BenchOptions, vocab_size: int) -> tuple[tuple[int, ...], int]:
    prompt = rng.integers(3, vocab_size, size=int(rng.integers(*options.input_range)))  # 0-2: special tokens
    return tuple(prompt.tolist()), int(rng.integers(*options.output_range))


def _trace(drawn: list[tuple[float, str, tuple[int, ...], int]], options: BenchOptions, rate: float,
           num_adapters: int) -> Trace:  # fmt: skip
    requests = tuple(TraceRequest(j, round(t, 6), adapter, prompt, output)
                     for j, (t, adapter, prompt, output) in enumerate(drawn))  # fmt: skip
    config = TraceConfig(num_adapters=num_adapters, req_rate=rate, duration=options.duration_s,
                         input_range=options.input_range, output_range=options.output_range,
                         seed=options.seed)  # fmt: skip
    return Trace(config, requests)


# ---- what a run measured ---------------------------------------------------------------------------------------


@dataclass
class Replayed:
    name: str
    trace: Trace
    records: list[RequestRecord]
    duration_s: float
    run: dict[str, Any]


def tenant_figures(records: list[RequestRecord], window: float) -> dict[str, dict[str, Any]]:
    """Per tenant: requests, finished, output tokens per second while requests arrived ([0, window]: a run with a
    noisy tenant drains its backlog for longer, which a whole-run average would charge to everyone), share of all
    output tokens, first-token p50/p90."""
    by_tenant: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        by_tenant[r.adapter or "<base>"].append(r)
    total = sum(r.num_output for r in records) or 1
    out = {}
    for tenant, rs in sorted(by_tenant.items()):
        ttfts = [r.ttft for r in rs if r.ok and r.ttft is not None]
        in_window = sum(k for r in rs for t, k in zip(r.chunk_times, r.chunk_tokens) if t <= window)
        out[tenant] = {
            "requests": len(rs),
            "finished": sum(1 for r in rs if r.ok),
            "output_tokens": sum(r.num_output for r in rs),
            "output_tok_s": in_window / window if window > 0 else 0.0,
            "share": sum(r.num_output for r in rs) / total,
            "ttft_p50_s": float(np.percentile(ttfts, 50)) if ttfts else None,
            "ttft_p90_s": float(np.percentile(ttfts, 90)) if ttfts else None,
        }
    return out


def service_gap(records: list[RequestRecord], duration: float, window: float, costs: tuple[float, float]) -> float:
    """The largest service difference between two tenants both backlogged over a whole window (windows of
    `window` seconds every window / 2): VTC's measure of fairness, in weighted tokens."""
    service, backlog = _service_events(records, costs)
    gap = 0.0
    start = 0.0
    while start + window <= duration + 1e-9:
        end = start + window
        served = [_served_within(*service[t], start, end) for t, spans in backlog.items() if _covers(spans, start, end)]
        if len(served) >= 2:
            gap = max(gap, max(served) - min(served))
        start += window / 2
    return gap


def _served_within(times: np.ndarray, cumulative: np.ndarray, start: float, end: float) -> float:
    lo, hi = np.searchsorted(times, [start, end])  # events in [start, end)
    return float(cumulative[hi] - cumulative[lo])


Spans = list[tuple[float, float]]


def _service_events(
    records: list[RequestRecord], costs: tuple[float, float]
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, Spans]]:
    """Per tenant: its service events as sorted times with cumulative service (from 0), and its backlogged spans
    (a request's arrival to its first token, or to its end if it had none)."""
    prompt_cost, output_cost = costs
    events: dict[str, list[tuple[float, float]]] = defaultdict(list)
    backlog: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in records:
        tenant = r.adapter or "<base>"
        end = r.chunk_times[0] if r.chunk_times else (r.finish_time if r.finish_time is not None else r.arrival)
        backlog[tenant].append((r.arrival, end))
        if r.chunk_times:
            events[tenant].append((r.chunk_times[0], prompt_cost * r.input_len))
        events[tenant] += [(t, output_cost * k) for t, k in zip(r.chunk_times, r.chunk_tokens)]
    service = {}
    for tenant in backlog:
        ordered = sorted(events[tenant])
        times = np.array([t for t, _ in ordered], dtype=np.float64)
        service[tenant] = times, np.concatenate([[0.0], np.cumsum([c for _, c in ordered])])
    return service, {t: _merged(spans) for t, spans in backlog.items()}


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _covers(spans: list[tuple[float, float]], start: float, end: float) -> bool:
    return any(a <= start and end <= b for a, b in spans)


def slo_figures(records: list[RequestRecord], duration: float, slo: float) -> dict[str, Any]:
    """SLO attainment of all offered requests and of the admitted ones (not refused), goodput (met / second)."""
    met = [r for r in records if r.ok and r.ttft is not None and r.ttft < slo]
    refused = [r for r in records if r.finish_reason == "rejected"]
    admitted = len(records) - len(refused)
    return {
        "slo_s": slo,
        "offered": len(records),
        "refused": len(refused),
        "met": len(met),
        "attainment_all": len(met) / len(records) if records else 0.0,
        "attainment_admitted": len(met) / admitted if admitted else None,
        "goodput_rps": len(met) / duration if duration > 0 else 0.0,
    }


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
    """One engine per EngineConfig variant (policy, SLO), kept for all the runs that use it."""

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

    def replay(self, name: str, trace: Trace, changes: dict[str, Any], window_s: float | None = None) -> Replayed:
        """Replay `trace` on the engine of `changes`; per-tenant throughput over [0, window_s] (default: the run)."""
        engine = self.engine(changes)
        engine.evict_adapters()
        before = engine.stats()
        with tqdm(total=len(trace), desc=name, unit="req", disable=not self.options.progress, leave=False) as bar:
            replay = _ProgressReplay(engine, trace, self.replay_options, bar)
            duration = replay.run()
        records = list(replay.records.values())
        metrics = summarize(records, duration)
        costs = (engine.config.fair_prompt_cost, engine.config.fair_output_cost)
        metrics.update(
            tenants=tenant_figures(records, window_s or duration),
            service_gap=service_gap(records, duration, self.options.gap_window * duration, costs),
            slo=slo_figures(records, duration, self.options.slo_s),
            refusals={k: getattr(engine.stats(), f"refused_{k}") - getattr(before, f"refused_{k}") for k in REASONS},
        )
        options = {**asdict(self.options), "mode": "lora", "engine_changes": changes, "engine": asdict(engine.config)}
        run = make_run(name, "engine", trace_info(trace), options, metrics, group="tenants")
        logger.info("%s | service gap %.0f | slo %s", headline(run), metrics["service_gap"], metrics["slo"])
        return Replayed(name, trace, records, duration, run)


def measure_capacity(bench: Bench) -> Replayed:
    """The burst run; its metrics get `capacity_rps`: completions per second between the 10th and the 80th
    percentile of finish times, where the batch is full (the ramp-up and the drain of the last long requests, which
    the whole run's average counts, would put the capacity below what a steady overload gets: measured on the H200,
    30 req/s over the whole burst while 36 req/s offered steadily were served with first tokens in 0.2 s)."""
    bench.engine(MODES["fcfs"])
    trace = burst_trace(bench.adapters, bench.options, bench.options.seed, bench.vocab_size)
    done = bench.replay("tenants-capacity", trace, MODES["fcfs"])
    done.run["metrics"]["capacity_rps"] = steady_rate(done.records)
    return done


def steady_rate(records: list[RequestRecord], low: float = 0.1, high: float = 0.8) -> float:
    """Completions per second between the `low` and `high` quantiles of the finish times."""
    ends = sorted(r.finish_time for r in records if r.ok and r.finish_time is not None)
    if len(ends) < 10:
        return len(ends) / ends[-1] if ends and ends[-1] > 0 else 0.0
    a, b = int(low * len(ends)), int(high * len(ends)) - 1
    return (b - a) / (ends[b] - ends[a]) if ends[b] > ends[a] else len(ends) / ends[-1]


def noisy_neighbour(bench: Bench, capacity: float, policy: str) -> list[dict[str, Any]]:
    """The runs with and without the noisy tenant under `policy`; the comparison goes into the `with` run's
    metrics (`vs_without`)."""
    o = bench.options
    rate = o.base_load * capacity / o.tenants
    quiet = {bench.adapters[i]: rate for i in range(o.tenants)}
    noisy_name = bench.adapters[o.noisy_tenant]
    changes = {"scheduling_policy": policy}
    quiet_trace = tenant_trace(quiet, o, o.seed + 1, bench.vocab_size)
    without = bench.replay(f"tenants-noisy-{policy}-without", quiet_trace, changes, o.duration_s)
    loud = tenant_trace({**quiet, noisy_name: o.noisy_factor * rate}, o, o.seed + 1, bench.vocab_size)
    with_ = bench.replay(f"tenants-noisy-{policy}-with", loud, changes, o.duration_s)
    comparison = compare_noisy(with_, without, list(quiet), noisy_name)
    with_.run["metrics"]["vs_without"] = comparison
    logger.info("noisy neighbour, %s: %s", policy, {k: v for k, v in comparison.items() if k != "tenants"})
    return [without.run, with_.run]


def compare_noisy(with_: Replayed, without: Replayed, quiet: list[str], noisy: str) -> dict[str, Any]:
    """Each well-behaved tenant's throughput and first-token p90 with the noisy tenant over without it."""
    a = with_.run["metrics"]["tenants"]
    b = without.run["metrics"]["tenants"]
    per = {}
    for t in quiet:
        if t not in a or t not in b:
            continue
        throughput = a[t]["output_tok_s"] / b[t]["output_tok_s"] if b[t]["output_tok_s"] else None
        p90_with, p90_without = a[t]["ttft_p90_s"], b[t]["ttft_p90_s"]
        ttft = p90_with / p90_without if p90_with is not None and p90_without else None
        per[t] = {"throughput_ratio": throughput, "ttft_p90_ratio": ttft}
    ratios = [v["throughput_ratio"] for v in per.values() if v["throughput_ratio"] is not None]
    ttfts = [v["ttft_p90_ratio"] for v in per.values() if v["ttft_p90_ratio"] is not None]
    return {
        "min_throughput_ratio": min(ratios) if ratios else None,  # the goal under fair: >= 0.9
        "max_ttft_p90_ratio": max(ttfts) if ttfts else None,  # goal: <= 1.5
        "noisy_share": a.get(noisy, {}).get("share"),
        "service_gap_with": with_.run["metrics"]["service_gap"],
        "service_gap_without": without.run["metrics"]["service_gap"],
        "tenants": per,
    }


def overload(bench: Bench, capacity: float, mode: str) -> list[dict[str, Any]]:
    """`mode` at each load (the same trace per load for every mode); each run's metrics get its load and its
    goodput over the capacity."""
    o = bench.options
    changes = dict(MODES[mode])
    if mode == "early-abort":
        changes["ttft_slo_s"] = o.slo_s
    runs = []
    for load in o.loads:
        rate = load * capacity / o.tenants
        trace = tenant_trace({bench.adapters[i]: rate for i in range(o.tenants)}, o, o.seed + 2, bench.vocab_size)
        done = bench.replay(f"tenants-overload-{load:g}x-{mode}", trace, changes, o.duration_s)
        m = done.run["metrics"]
        m.update(load=load, capacity_rps=capacity, goodput_over_capacity=m["slo"]["goodput_rps"] / capacity)
        logger.info("overload %.1fx %-11s attainment all %.3f admitted %s goodput %.2f req/s (%.2f of capacity)",
                    load, mode, m["slo"]["attainment_all"], _fmt(m["slo"]["attainment_admitted"]),
                    m["slo"]["goodput_rps"], m["goodput_over_capacity"])  # fmt: skip
        runs.append(done.run)
    return runs


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def run(base: EngineConfig, options: BenchOptions, adapters: list[str], out: Path, suites: tuple[str, ...]) -> None:
    """Capacity, then per engine configuration (fcfs, fair, early abort: one engine each) its runs."""
    if len(adapters) < options.tenants + 1:
        raise ValueError(f"{options.tenants + 1} adapters needed (tenants + the noisy one), found {len(adapters)}")
    bench = Bench(base, options, adapters)
    capacity_run = measure_capacity(bench)
    append_runs(out, [capacity_run.run])
    capacity = capacity_run.run["metrics"]["capacity_rps"]
    logger.info("capacity: %.2f req/s", capacity)
    order = list(dict.fromkeys(["fcfs", *options.policies, *options.modes]))
    for name in order:
        if "noisy" in suites and name in options.policies:
            append_runs(out, noisy_neighbour(bench, capacity, name))
        if "overload" in suites and name in options.modes:
            append_runs(out, overload(bench, capacity, name))


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
    parser.add_argument("--suite", choices=("noisy", "overload", "all"), default="all")
    parser.add_argument("--policies", nargs="+", choices=("fcfs", "fair", "priority"),
                        help="noisy neighbour: the policies compared (default: fcfs fair)")  # fmt: skip
    parser.add_argument("--modes", nargs="+", choices=tuple(MODES), help="overload: the modes (default: all)")
    parser.add_argument("--tenants", type=int)
    parser.add_argument("--duration", type=float, help="seconds of arrivals per run")
    parser.add_argument("--loads", type=float, nargs="+", help="overload runs, in units of the measured capacity")
    parser.add_argument("--slo", type=float, help="first-token SLO, seconds (early abort's ttft_slo_s)")
    parser.add_argument("--base-load", type=float, help="the well-behaved tenants together, in units of capacity")
    parser.add_argument("--time-limit", type=float, help="seconds per run")
    parser.add_argument("--capacity-requests", type=int, help="requests of the capacity run, offered at once")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", type=Path, required=True, help="results JSON (runs are added to it)")
    args = parser.parse_args(argv)
    if not args.smoke and (args.model is None or args.adapter_root is None):
        parser.error("--model and --adapter-root are needed without --smoke")
    return args


def bench_options(args: argparse.Namespace) -> BenchOptions:
    options = SMOKE if args.smoke else BenchOptions()
    changes = {"tenants": args.tenants, "duration_s": args.duration, "slo_s": args.slo, "base_load": args.base_load,
               "time_limit_s": args.time_limit, "loads": tuple(args.loads) if args.loads else None,
               "capacity_requests": args.capacity_requests, "policies": tuple(args.policies or ()) or None,
               "modes": tuple(args.modes or ()) or None}  # fmt: skip
    return replace(options, progress=not args.no_progress, **{k: v for k, v in changes.items() if v is not None})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    options = bench_options(args)
    suites = ("noisy", "overload") if args.suite == "all" else (args.suite,)
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
