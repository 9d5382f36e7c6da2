"""The noisy-neighbour suite on the scheduler alone: no model, no GPU, a step's time from a linear model.

    python -m perf.sim_noisy --capacity 35 --seeds 0 1 2

Each seed's trace is perf/tenant_suites.py's (tenant_trace): `tenants` tenants at equal Poisson rates summing to
base_load × capacity, lengths U[8, 512), once without and once with one more tenant at noisy_factor times a
tenant's rate, served by the fair policy with the itl_slo_s cap (batch_limit.py) as the engine would, each step taking
base + per_seq × batch + per_prompt_token × prompt tokens seconds. It prints each light tenant's first-token p90
with over without the noisy tenant (the worst and the median) and how many light first tokens took longer than
`late_s`; with --trace-noise, also the worst ratio between two runs without the noisy tenant over traces of
different seeds (how far a tenant's p90 of ~50 first tokens moves with its requests alone). It shows what the
scheduler does to the light tenants in seconds instead of a GPU session; the GPU figures
(perf/bench_tenants_served.py) are the ones that count.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np

from perf.tenant_suites import BenchOptions, tenant_trace
from perf.workload import Trace
from slora.backend.engine.batch_limit import BatchLimiter
from slora.backend.engine.request import Request
from slora.backend.engine.scheduler import SchedulerOutput
from tests.engine.scheduler_sim import Sim, make_request, make_sim

logger = logging.getLogger("perf.sim_noisy")
VOCAB_SIZE = 32000  # the prompts' token ids only fill the trace: the scheduler counts them
NOISE_SEED_OFFSET = 1000  # --trace-noise: the other trace's seed, clear of the seeds a run compares


@dataclass(frozen=True)
class StepModel:
    base_s: float = 0.006
    per_seq_s: float = 0.00007
    per_prompt_token_s: float = 0.000015

    def seconds(self, plan: SchedulerOutput) -> float:
        prompt = sum(s.num_tokens for s in plan.seqs if s.num_tokens > 1)
        return self.base_s + self.per_seq_s * len(plan.seqs) + self.per_prompt_token_s * prompt


@dataclass(frozen=True)
class EngineShape:
    """The engine options the scheduler sees."""

    itl_slo_s: float = 0.018
    max_num_seqs: int = 256
    max_batch_tokens: int = 8192
    admit_interval: int = 2


def replay(
    arrivals: Trace, model: StepModel, engine: EngineShape, start_cap: int | None = None
) -> dict[str, list[float]]:
    """Each tenant's first-token latencies. `start_cap`: the cap as a cut before the trace left it (on the GPU,
    the benchmark's own warm-up requests cut it far down before its first run: perf/RESULTS.md, session 25)."""
    limiter = BatchLimiter(engine.itl_slo_s, engine.max_num_seqs)
    if start_cap is not None:
        limiter.cap = min(start_cap, engine.max_num_seqs)
    sim = make_sim("fair", pages=200_000, max_batch_tokens=engine.max_batch_tokens, max_num_seqs=engine.max_num_seqs,
                   limiter=limiter, admit_interval=engine.admit_interval)  # fmt: skip
    start = sim.clock.now
    arrived: dict[str, float] = {}
    ttft: dict[str, list[float]] = {}
    requests, i = arrivals.requests, 0
    while i < len(requests) or sim.scheduler.has_work():
        while i < len(requests) and start + requests[i].arrival <= sim.clock.now:
            a = requests[i]
            request = make_request(f"r{i}", a.adapter or "", a.input_len, a.output_len, arrival=start + a.arrival)
            arrived[request.request_id] = start + a.arrival
            sim.add(request)
            i += 1
        if not sim.scheduler.has_work():
            sim.clock.now = start + requests[i].arrival
            continue
        for request in _step(sim, model):
            ttft.setdefault(request.tenant, []).append(sim.clock.now - arrived[request.request_id])
    return ttft


def _step(sim: Sim, model: StepModel) -> list[Request]:
    """One step; the requests that sampled their first token in it."""
    plan = sim.scheduler.schedule()
    for seq in plan.seqs:
        seq.request.num_computed += seq.num_tokens
    sim.clock.now += model.seconds(plan)
    if plan.seqs:
        sim.scheduler.step_done()  # the step's tokens, at its end
    first = []
    for seq in plan.seqs:
        request = seq.request
        if request.num_computed < request.num_tokens:
            continue
        if request.num_output == 0:
            first.append(request)
        request.token_ids.append(0)
        if request.num_output >= request.sampling.max_tokens:
            sim.scheduler.release(request)
    return first


def compare(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rate = args.base_load * args.capacity / args.tenants
    light = {f"t{k}": rate for k in range(args.tenants)}
    model = StepModel(args.base_s, args.per_seq_s, args.per_prompt_token_s)
    engine = EngineShape(args.itl_slo, args.max_num_seqs, args.max_batch_tokens, args.admit_interval)
    options = BenchOptions(tenants=args.tenants, duration_s=args.duration, progress=False)
    runs = [light, {**light, "noisy": args.noisy_factor * rate}]
    without, with_ = (replay(tenant_trace(rates, options, seed, VOCAB_SIZE), model, engine, args.start_cap)
                      for rates in runs)  # fmt: skip
    ratios = [_p90(with_[t]) / _p90(without[t]) for t in light]
    out = {"seed": seed, "max_ttft_p90_ratio": round(max(ratios), 3),
           "median_ttft_p90_ratio": round(statistics.median(ratios), 3),
           "late_light_first_tokens": _late(with_, light, args.late_s),
           "late_without": _late(without, light, args.late_s)}  # fmt: skip
    if args.trace_noise:
        other_trace = tenant_trace(light, options, seed + NOISE_SEED_OFFSET, VOCAB_SIZE)
        other = replay(other_trace, model, engine, args.start_cap)
        out["trace_noise_max_ttft_p90_ratio"] = round(max(_p90(other[t]) / _p90(without[t]) for t in light), 3)
    return out


def _late(ttft: dict[str, list[float]], tenants: dict[str, float], late_s: float) -> int:
    return sum(v > late_s for t in tenants for v in ttft[t])


def _p90(values: list[float]) -> float:
    return float(np.percentile(values, 90))


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacity", type=float, default=35.0, help="req/s the light tenants' load is scaled by")
    parser.add_argument("--itl-slo", type=float, default=EngineShape.itl_slo_s)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tenants", type=int, default=20)
    parser.add_argument("--base-load", type=float, default=0.8)
    parser.add_argument("--noisy-factor", type=float, default=10.0)
    parser.add_argument("--max-num-seqs", type=int, default=EngineShape.max_num_seqs)
    parser.add_argument("--max-batch-tokens", type=int, default=EngineShape.max_batch_tokens)
    parser.add_argument("--admit-interval", type=int, default=EngineShape.admit_interval)
    parser.add_argument("--trace-noise", action="store_true",
                        help="also compare the run without the noisy tenant with another seed's")  # fmt: skip
    parser.add_argument("--late-s", type=float, default=0.15)
    parser.add_argument("--start-cap", type=int, help="the cap at the trace's start (default: max_num_seqs)")
    parser.add_argument("--base-s", type=float, default=StepModel.base_s)
    parser.add_argument("--per-seq-s", type=float, default=StepModel.per_seq_s)
    parser.add_argument("--per-prompt-token-s", type=float, default=StepModel.per_prompt_token_s)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("slora").setLevel(logging.WARNING)  # the cap's every cut: thousands of lines a run
    for seed in args.seeds:
        logger.info(json.dumps(compare(args, seed)))


if __name__ == "__main__":
    main()
