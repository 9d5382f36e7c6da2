"""The tenant-isolation benchmark's plan, whatever serves it: its options, its traces, and the suites (capacity,
noisy neighbour, overload) run against a TenantBench, the engine in process (perf/bench_tenants.py) or the
Triton server (perf/bench_tenants_served.py).

Each tenant is one adapter; requests have S-LoRA's uniform lengths and Poisson arrivals. What runs, in order:

- capacity: `capacity_requests` requests offered at once under fcfs: completions per second while the batch is
  full (between the 10th and 80th percentiles of the finish times), C.
- noisy neighbour, per policy in `policies`: `tenants` tenants at equal rates summing to base_load × C, once with
  one more tenant at noisy_factor times a tenant's rate and once without it. For each well-behaved tenant: its
  throughput (output tokens per second while requests arrive) with the noisy tenant over without, its first-token
  p90 with over without; and the largest service difference between two tenants backlogged over a whole window
  (VTC's measure; perf/tenant_measures.py). With `repeat_without`, the run without it is replayed once more
  after the run with it, and compared with the first as the noisy run is (`vs_without` of the repeat, `repeat` in
  the noisy run's comparison): how far a tenant's p90 moves between two runs of one trace with nothing changed,
  the yardstick for the noisy run's ratios (a p90 of ~50 requests rests on its few slowest).
- overload at each of `loads` × C, per mode: fcfs, fair, early abort (fcfs with ttft_slo_s = slo_s), priority:
  SLO attainment of all offered requests (a refused one misses), of the admitted ones, and goodput (requests that
  met the SLO per second of the run). At a load of 1 the modes' throughputs against fcfs's are what each policy
  costs when nothing is overloaded.

A server-wide configuration (an engine, or a server) is named by its EngineConfig changes: `configuration`.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from perf.metrics import RequestRecord, summarize
from perf.results import append_runs
from perf.tenant_measures import compare_noisy, service_gap, slo_figures, steady_rate, tenant_figures
from perf.workload import Trace, TraceConfig, TraceRequest

logger = logging.getLogger(__name__)

REASONS = ("ttft_slo", "ttft_slo_early", "queue_timeout")  # EngineStats.refused_<reason>
MODES: dict[str, dict[str, Any]] = {  # overload modes: EngineConfig changes
    "fcfs": {"scheduling_policy": "fcfs"},
    "fair": {"scheduling_policy": "fair"},
    "early-abort": {"scheduling_policy": "fcfs", "early_abort": True},  # + ttft_slo_s
    "priority": {"scheduling_policy": "priority"},  # at 1x: what the policy costs without overload
}
POLICIES = ("fcfs", "fair", "priority")  # noisy neighbour: scheduling_policy values


@dataclass(frozen=True)
class BenchOptions:
    tenants: int = 20
    noisy_factor: float = 10.0
    base_load: float = 0.8  # the well-behaved tenants together, in units of capacity
    policies: tuple[str, ...] = ("fcfs", "fair")
    loads: tuple[float, ...] = (1.0, 1.5, 2.0, 4.0)
    modes: tuple[str, ...] = ("fcfs", "fair", "early-abort")
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
    repeat_without: bool = False  # noisy neighbour: the run without the noisy tenant once more, after the one with it

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
        for policy in self.policies:
            if policy not in POLICIES:
                raise ValueError(f"policies must be among {', '.join(POLICIES)}, got {policy!r}")
        if self.capacity_requests < 1:
            raise ValueError(f"capacity_requests must be >= 1, got {self.capacity_requests}")

    @property
    def noisy_tenant(self) -> int:
        return self.tenants  # adapter index of the noisy tenant: the one after the well-behaved ones


SMOKE = BenchOptions(tenants=4, duration_s=1.0, capacity_requests=48, input_range=(4, 24), output_range=(4, 24),
                     slo_s=0.5, time_limit_s=30.0, warmup_requests=(4,), loads=(1.0, 2.0, 4.0))  # fmt: skip


def mode_changes(mode: str, options: BenchOptions) -> dict[str, Any]:
    """The EngineConfig changes of an overload mode (early abort's SLO is the options' slo_s)."""
    changes = dict(MODES[mode])
    if mode == "early-abort":
        changes["ttft_slo_s"] = options.slo_s
    return changes


def configurations(options: BenchOptions, suites: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """The server-wide configurations the suites need, by name, in the order they run: fcfs (the capacity) first."""
    names = ["fcfs", *(options.policies if "noisy" in suites else ()), *(options.modes if "overload" in suites else ())]
    out = {}
    for name in dict.fromkeys(names):
        out[name] = mode_changes(name, options) if name in MODES else {"scheduling_policy": name}
    return out


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


# ---- what serves the runs ----------------------------------------------------------------------------------------


@dataclass
class Replayed:
    name: str
    trace: Trace
    records: list[RequestRecord]
    duration_s: float
    run: dict[str, Any]


class TenantBench(Protocol):
    """What the suites need from whatever serves them."""

    options: BenchOptions
    adapters: list[str]  # tenants + 1: the well-behaved ones, then the noisy one
    prefix: str  # of the run names

    @property
    def vocab_size(self) -> int: ...

    def prepare(self, changes: dict[str, Any]) -> None:
        """Make the configuration of `changes` the one that serves the next runs (vocab_size known after)."""

    def replay(self, name: str, trace: Trace, changes: dict[str, Any], window_s: float | None = None) -> Replayed:
        """Replay `trace` on the configuration of `changes`; per-tenant throughput over [0, window_s]."""
        ...


def tenant_metrics(
    records: list[RequestRecord], duration: float, window_s: float, options: BenchOptions, costs: tuple[float, float]
) -> dict[str, Any]:
    """perf/metrics' summary of a run with its `tenants`, `service_gap` and `slo`; `costs`: the fair policy's
    (fair_prompt_cost, fair_output_cost) that the service gap counts in."""
    metrics = summarize(records, duration, slo_s=options.slo_s)  # one SLO for the run line and the slo figures
    metrics.update(
        tenants=tenant_figures(records, window_s),
        service_gap=service_gap(records, duration, options.gap_window * duration, costs),
        slo=slo_figures(records, duration, options.slo_s),
    )
    return metrics


# ---- the suites --------------------------------------------------------------------------------------------------


def measure_capacity(bench: TenantBench, changes: dict[str, Any] | None = None) -> Replayed:
    """The burst run (under fcfs unless `changes` say otherwise); its metrics get `capacity_rps`: completions per
    second between the 10th and the 80th percentile of finish times, where the batch is full (the whole run's
    average also counts the ramp-up and the drain of the last long requests). A burst prefills every prompt at
    once and then decodes alone, which a steady overload never does, so this rate only scales the loads offered:
    the report also divides goodput by what fcfs completed on the overload trace itself."""
    changes = MODES["fcfs"] if changes is None else changes
    bench.prepare(changes)
    trace = burst_trace(bench.adapters, bench.options, bench.options.seed, bench.vocab_size)
    done = bench.replay(f"{bench.prefix}-capacity", trace, changes)
    done.run["metrics"]["capacity_rps"] = steady_rate(done.records)
    return done


def noisy_neighbour(bench: TenantBench, capacity: float, policy: str) -> list[dict[str, Any]]:
    """The runs with and without the noisy tenant under `policy`; the comparison goes into the `with` run's
    metrics (`vs_without`)."""
    o = bench.options
    rate = o.base_load * capacity / o.tenants
    quiet = {bench.adapters[i]: rate for i in range(o.tenants)}
    noisy_name = bench.adapters[o.noisy_tenant]
    changes = {"scheduling_policy": policy}
    bench.prepare(changes)
    quiet_trace = tenant_trace(quiet, o, o.seed + 1, bench.vocab_size)
    without = bench.replay(f"{bench.prefix}-noisy-{policy}-without", quiet_trace, changes, o.duration_s)
    loud = tenant_trace({**quiet, noisy_name: o.noisy_factor * rate}, o, o.seed + 1, bench.vocab_size)
    with_ = bench.replay(f"{bench.prefix}-noisy-{policy}-with", loud, changes, o.duration_s)
    comparison = compare_noisy(with_.run["metrics"], without.run["metrics"], list(quiet), noisy_name)
    with_.run["metrics"]["vs_without"] = comparison
    runs = [without.run, with_.run]
    if o.repeat_without:
        again = bench.replay(f"{bench.prefix}-noisy-{policy}-without-again", quiet_trace, changes, o.duration_s)
        repeat = compare_noisy(again.run["metrics"], without.run["metrics"], list(quiet), noisy_name)
        again.run["metrics"]["vs_without"] = repeat
        comparison["repeat"] = {k: repeat[k] for k in ("min_throughput_ratio", "max_ttft_p90_ratio")}
        runs.append(again.run)
    logger.info("noisy neighbour, %s: %s", policy, {k: v for k, v in comparison.items() if k != "tenants"})
    return runs


def overload(bench: TenantBench, capacity: float, mode: str) -> list[dict[str, Any]]:
    """`mode` at each load (the same trace per load for every mode); each run's metrics get its load and its
    goodput over the capacity."""
    o = bench.options
    changes = mode_changes(mode, o)
    bench.prepare(changes)
    runs = []
    for load in o.loads:
        rate = load * capacity / o.tenants
        trace = tenant_trace({bench.adapters[i]: rate for i in range(o.tenants)}, o, o.seed + 2, bench.vocab_size)
        done = bench.replay(f"{bench.prefix}-overload-{load:g}x-{mode}", trace, changes, o.duration_s)
        m = done.run["metrics"]
        m.update(load=load, capacity_rps=capacity, goodput_over_capacity=m["slo"]["goodput_rps"] / capacity)
        logger.info("overload %.1fx %-11s attainment all %.3f admitted %s goodput %.2f req/s (%.2f of capacity)",
                    load, mode, m["slo"]["attainment_all"], _fmt(m["slo"]["attainment_admitted"]),
                    m["slo"]["goodput_rps"], m["goodput_over_capacity"])  # fmt: skip
        runs.append(done.run)
    return runs


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def run_suites(bench: TenantBench, out: Path, suites: tuple[str, ...], capacity: float | None = None) -> None:
    """Capacity (measured unless given), then per configuration (fcfs, fair, early abort, ...) its runs, each
    appended to `out` as it ends."""
    o = bench.options
    if len(bench.adapters) < o.tenants + 1:
        raise ValueError(f"{o.tenants + 1} adapters needed (tenants + the noisy one), found {len(bench.adapters)}")
    if capacity is None:
        capacity_run = measure_capacity(bench)
        append_runs(out, [capacity_run.run])
        capacity = float(capacity_run.run["metrics"]["capacity_rps"])
    logger.info("capacity: %.2f req/s", capacity)
    if capacity <= 0:
        raise RuntimeError("the capacity run finished no request: nothing to scale the loads by")
    for name in configurations(o, suites):
        if "noisy" in suites and name in o.policies:
            append_runs(out, noisy_neighbour(bench, capacity, name))
        if "overload" in suites and name in o.modes:
            append_runs(out, overload(bench, capacity, name))


# ---- command line, shared by both benchmarks ------------------------------------------------------------------


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The suites, their sizes and the results file."""
    parser.add_argument("--suite", choices=("noisy", "overload", "all"), default="all")
    parser.add_argument("--policies", nargs="+", choices=POLICIES,
                        help="noisy neighbour: the policies compared (default: fcfs fair)")  # fmt: skip
    parser.add_argument("--modes", nargs="+", choices=tuple(MODES),
                        help="overload: the modes (default: fcfs fair early-abort)")  # fmt: skip
    parser.add_argument("--tenants", type=int)
    parser.add_argument("--duration", type=float, help="seconds of arrivals per run")
    parser.add_argument("--loads", type=float, nargs="+", help="overload runs, in units of the measured capacity")
    parser.add_argument("--slo", type=float, help="first-token SLO, seconds (early abort's ttft_slo_s)")
    parser.add_argument("--base-load", type=float, help="the well-behaved tenants together, in units of capacity")
    parser.add_argument("--time-limit", type=float, help="seconds per run")
    parser.add_argument("--capacity-requests", type=int, help="requests of the capacity run, offered at once")
    parser.add_argument("--repeat-without", action="store_true",
                        help="noisy neighbour: replay the run without the noisy tenant again after the one with it, "
                             "to show how far the ratios move with nothing changed")  # fmt: skip
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", type=Path, required=True, help="results JSON (runs are added to it)")


def plan_from_args(args: argparse.Namespace) -> tuple[BenchOptions, tuple[str, ...]]:
    """The options (SMOKE's with --smoke, else the defaults, changed by the flags given) and the suites."""
    options = SMOKE if args.smoke else BenchOptions()
    changes = {"tenants": args.tenants, "duration_s": args.duration, "slo_s": args.slo, "base_load": args.base_load,
               "time_limit_s": args.time_limit, "loads": tuple(args.loads) if args.loads else None,
               "capacity_requests": args.capacity_requests, "policies": tuple(args.policies or ()) or None,
               "modes": tuple(args.modes or ()) or None, "repeat_without": args.repeat_without or None}  # fmt: skip
    options = replace(options, progress=not args.no_progress, **{k: v for k, v in changes.items() if v is not None})
    return options, ("noisy", "overload") if args.suite == "all" else (args.suite,)
