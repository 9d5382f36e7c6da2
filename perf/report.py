"""A markdown report of a results file: every run, and each target of issue 5 checked against measured runs.

    python -m perf.report results.json [more-results.json ...] --out report.md

Targets (perf/RESULTS.md) and which runs each compares, all taken from the same results file:
    s1-2000       S1, n=2000, adapters on: throughput >= 24 req/s                   (engine and serving runs)
    n2000-vs-n5   throughput at n=2000 >= 0.95 x at n=5                              (same group and setting)
    lora-vs-base  adapters on >= 0.90 x base model alone, on the same trace file     (same group)
    vs-peft       ours >= 30 x HF PEFT on the same trace file                        (each PEFT run)
    served        through Triton >= 0.90 x in-process, same trace file, mode and kernels (each serving run)
    base-roofline a base-model run >= 0.70 of its roofline (issue 27)     (runs whose roofline the GPU limits)
    bytes-floor   S2 / S-all against base >= 0.97 x the roofline's ratio at saturation (issue 27)  (lora-vs-base pairs)
Nothing is computed from numbers that were not measured: a target with no pair of runs is listed as not run.

Sections after the targets: every run (with its roofline req/s and fraction), the headline runs of S-LoRA's method
(served, with trace length, rate, TTFT p50 / p99 and the roofline fraction; traces under 60 s flagged), TTFT at
fractions of capacity (bench_serving --sweep), each run's roofline (perf/roofline.py: steps, bytes, FLOPs), the
LoRA runs against their base run and the bytes floor of that ratio, the engine's steps by kind, and the tenant
suites' runs against issue 26's goals (perf/report_tenants.py).
Runs of several files (several GPU calls) can be compared; the report lists each file's commit and device, and a
pair is only as good as the two runs being on the same commit and GPU.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perf.report_tenants import fmt, noisy_table, overload_table
from perf.results import load_runs

logger = logging.getLogger(__name__)

Run = dict[str, Any]


@dataclass(frozen=True)
class Check:
    target: str
    subject: str
    reference: str
    value: float
    goal: float
    unit: str  # "req/s" or "x"

    @property
    def passed(self) -> bool:
        return self.value >= self.goal


def _n(run: Run) -> int:
    return int(run["trace"]["config"]["num_adapters"])


def _setting(run: Run) -> str:
    return str(run["trace"]["config"]["adapter_prefix"]).rstrip("-")


def _mode(run: Run) -> str:
    return str(run["options"].get("mode", "lora"))


def _trace(run: Run) -> str:
    return Path(run["trace"].get("path") or "?").stem


def _rps(run: Run) -> float:
    return float(run["metrics"]["throughput_rps"])


def _group(run: Run) -> str:
    return str(run.get("group", run["kind"]))


def _ratio(target: str, subject: Run, reference: Run, goal: float) -> Check | None:
    if _rps(reference) <= 0:
        return None
    return Check(target, subject["name"], reference["name"], _rps(subject) / _rps(reference), goal, "x")


def check_s1_2000(runs: list[Run]) -> Iterator[Check]:
    for run in runs:
        if run["kind"] in ("engine", "serving") and _setting(run) == "s1" and _n(run) == 2000 and _mode(run) == "lora":
            yield Check("s1-2000", run["name"], "-", _rps(run), 24.0, "req/s")


def check_scaling(runs: list[Run]) -> Iterator[Check]:
    lora = [r for r in runs if r["kind"] != "peft" and _mode(r) == "lora"]
    for big in (r for r in lora if _n(r) == 2000):
        for small in lora:
            if _n(small) == 5 and _group(small) == _group(big) and _setting(small) == _setting(big):
                if (check := _ratio("n2000-vs-n5", big, small, 0.95)) is not None:
                    yield check


def _pairs(runs: list[Run], subject: Callable[[Run], bool], reference: Callable[[Run, Run], bool]) -> Iterator:
    for s in runs:
        if subject(s):
            for r in runs:
                if r is not s and reference(s, r):
                    yield s, r


def check_lora_vs_base(runs: list[Run]) -> Iterator[Check]:
    def is_lora(r: Run) -> bool:
        return r["kind"] != "peft" and _mode(r) in ("lora", "single") and _n(r) > 0

    def same_base(s: Run, r: Run) -> bool:
        return _mode(r) == "base" and _group(r) == _group(s) and _trace(r) == _trace(s)

    for s, r in _pairs(runs, is_lora, same_base):
        if (check := _ratio("lora-vs-base", s, r, 0.90)) is not None:
            yield check


def check_vs_peft(runs: list[Run]) -> Iterator[Check]:
    def ours(r: Run) -> bool:
        return r["kind"] in ("engine", "serving") and _mode(r) == "lora"

    def same_peft(s: Run, r: Run) -> bool:
        return r["kind"] == "peft" and _trace(r) == _trace(s)

    for s, r in _pairs(runs, ours, same_peft):
        if (check := _ratio("vs-peft", s, r, 30.0)) is not None:
            yield check


def _kernels(run: Run) -> str | None:
    if run["kind"] == "serving":
        return run["options"].get("server_kernel_backend")
    return run["options"].get("engine", {}).get("config", {}).get("kernel_backend")


def check_served(runs: list[Run]) -> Iterator[Check]:
    def same_engine(s: Run, r: Run) -> bool:
        kernels = _kernels(s)
        same_kernels = kernels is None or _kernels(r) == kernels
        return r["kind"] == "engine" and _trace(r) == _trace(s) and _mode(r) == _mode(s) and same_kernels

    for s, r in _pairs(runs, lambda r: r["kind"] == "serving", same_engine):
        if (check := _ratio("served", s, r, 0.90)) is not None:
            yield check


def check_base_roofline(runs: list[Run]) -> Iterator[Check]:
    """Base-model runs whose roofline the GPU limits (on a trace limited by its arrivals any run comes near it)."""
    for run in runs:
        share, roof = run["metrics"].get("roofline_fraction"), _roof(run)
        if run["kind"] != "peft" and _mode(run) == "base" and share is not None and roof and _limit(roof) == "GPU":
            yield Check("base-roofline", run["name"], "roofline", float(share), 0.70, "x")


def check_disk_tier(runs: list[Run]) -> Iterator[Check]:
    """Issue 27: served S2 over 2000 adapters, beyond the host budget, against the same trace over 700 that fit, on
    one server (run_lab.sh disk-tier)."""

    def s2(r: Run, n: int) -> bool:
        return r["kind"] == "serving" and _setting(r) == "s2" and _n(r) == n and _mode(r) == "lora"

    def fits(s: Run, r: Run) -> bool:
        return s2(r, 700) and _group(r) == _group(s)

    for s, r in _pairs(runs, lambda r: s2(r, 2000), fits):
        if (check := _ratio("disk-tier", s, r, 0.90)) is not None:
            yield check


def check_bytes_floor(runs: list[Run]) -> Iterator[Check]:
    """Issue 27: S2 and S-all runs against their base run, as a share of the bytes floor of that ratio (the
    roofline's LoRA / base at saturation: what their adapters' rows cost at the least), not of a fixed ratio, since
    their adapters are up to 8x S1's bytes."""
    by_name = {run["name"]: run for run in runs}
    for check in check_lora_vs_base(runs):
        lora, base = by_name[check.subject], by_name[check.reference]
        floor = _ratio_of(lora, base, "burst")
        if _setting(lora) in ("s2", "sall") and floor:
            yield Check("bytes-floor", check.subject, check.reference, check.value / floor, 0.97, "x")


CHECKS = (check_s1_2000, check_scaling, check_lora_vs_base, check_vs_peft, check_served, check_base_roofline,
          check_disk_tier, check_bytes_floor)  # fmt: skip
TARGETS = ("s1-2000", "n2000-vs-n5", "lora-vs-base", "vs-peft", "served", "base-roofline", "disk-tier", "bytes-floor")


def _roof(run: Run) -> dict[str, Any] | None:
    roof = run["metrics"].get("roofline")
    return roof if isinstance(roof, dict) else None


def _roof_rps(run: Run, key: str | None = None) -> float | None:
    roof = _roof(run)
    if roof is None:
        return None
    return float(roof[key]["rps"] if key else roof["rps"])


def _ttft(m: dict[str, Any]) -> str:
    return f"{fmt(m['ttft_s']['p50'])} / {fmt(m['ttft_s']['p99'])}"


def runs_table(runs: list[Run]) -> list[str]:
    lines = [
        "| run | kind | n | mode | done | req/s | window req/s | out tok/s | TTFT p50 / p99 (s) | "
        "E2E p50 / p99 (s) | SLO | satisfaction | roofline req/s | of roofline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        m = run["metrics"]
        lines.append(
            f"| {run['name']} | {run['kind']} | {_n(run)} | {_mode(run)} | {m['num_finished']}/{m['num_requests']} "
            f"| {fmt(m['throughput_rps'])} | {fmt(m.get('window_rps'))} | {fmt(m['output_tok_s'], 0)} "
            f"| {_ttft(m)} | {fmt(m['e2e_s']['p50'])} / {fmt(m['e2e_s']['p99'])} "
            f"| {fmt(m['slo_attainment'], 3)} | {fmt(m['user_satisfaction'], 3)} "
            f"| {fmt(_roof_rps(run))} | {fmt(m.get('roofline_fraction'), 3)} |"
        )
    return lines


MIN_HEADLINE_S = 60.0  # S-LoRA's method: shorter traces are decided by their drain


def headline_table(runs: list[Run]) -> list[str]:
    """Served runs as S-LoRA's Table 3 reports them: throughput on a long trace at a saturating rate, with TTFT."""
    lines = ["| run | n | mode | trace s | rate req/s | req/s | TTFT p50 / p99 (s) | of roofline | note |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for run in runs:
        if run["kind"] != "serving" or run.get("sweep", {}).get("role") == "load":
            continue
        m, config = run["metrics"], run["trace"]["config"]
        duration, rate = config.get("duration"), config.get("req_rate")
        notes = ["short trace: the drain weighs"] if duration is None or duration < MIN_HEADLINE_S else []
        if run.get("sweep", {}).get("saturated") is False:
            notes.append("not saturated")
        lines.append(f"| {run['name']} | {_n(run)} | {_mode(run)} | {fmt(duration, 0)} | {fmt(rate, 1)} "
                     f"| {fmt(m['throughput_rps'])} | {_ttft(m)} | {fmt(m.get('roofline_fraction'), 3)} "
                     f"| {'; '.join(notes)} |")  # fmt: skip
    return lines if len(lines) > 2 else []


def sweep_table(runs: list[Run]) -> list[str]:
    """bench_serving --sweep: each capacity run, then its runs at fractions of that capacity."""
    lines = ["| capacity run | capacity req/s | load | offered req/s | req/s | TTFT p50 / p99 (s) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for first in (r for r in runs if r.get("sweep", {}).get("role") == "capacity"):
        capacity = float(first["sweep"]["capacity_rps"])
        bound = "" if first["sweep"].get("saturated", True) else " (at least: not saturated)"
        rows = [first] + [r for r in runs if r.get("sweep", {}).get("capacity_run") == first["name"]]
        for run in rows:
            load = run["sweep"].get("load_fraction")
            label = "capacity" if load is None else f"{load:.0%}"
            offered = run["trace"]["config"].get("req_rate")
            lines.append(f"| {first['name']} | {capacity:.2f}{bound} | {label} | {fmt(offered)} "
                         f"| {fmt(run['metrics']['throughput_rps'])} | {_ttft(run['metrics'])} |")  # fmt: skip
    return lines if len(lines) > 2 else []


def roofline_table(runs: list[Run]) -> list[str]:
    """Each run's roofline: the ideal engine's steps, the bytes and FLOPs of the trace, the least time, and what
    limits it: the GPU, or the trace's arrivals (the ideal engine could serve the same requests faster in a burst,
    so the trace does not saturate it and its fraction says more about the arrivals than about the GPU). "window
    of burst": the run's steady rate (while requests arrived) against the burst's, the capacity's fraction of the
    roofline when the trace saturates the server."""
    header = ("run", "steps", "bound by bytes", "GB weights / KV / adapters", "TFLOP", "roofline s", "measured s",
              "of roofline", "burst req/s", "window of burst", "limited by", "peaks")  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        roof = _roof(run)
        if roof is None:
            continue
        gb = {kind: value / 1e9 for kind, value in roof["bytes"].items()}
        weights, kv = gb["weights"] + gb["lm_head"] + gb["embeddings"], gb["kv_read"] + gb["kv_write"]
        bound = roof["memory_bound_steps"] / max(roof["steps"], 1)
        window = run["metrics"].get("window_rps")
        of_burst = window / float(roof["burst"]["rps"]) if window and roof["burst"]["rps"] else None
        lines.append(f"| {run['name']} | {roof['steps']} | {bound:.0%} | {weights:.0f} / {kv:.0f} / "
                     f"{gb['adapters']:.1f} | {sum(roof['flops'].values()) / 1e12:.0f} | {roof['seconds']:.2f} "
                     f"| {run['metrics']['duration_s']:.2f} | {fmt(run['metrics'].get('roofline_fraction'), 3)} "
                     f"| {roof['burst']['rps']:.2f} | {fmt(of_burst, 3)} | {_limit(roof)} "
                     f"| {roof['peaks']['source']} |")  # fmt: skip
    return lines if len(lines) > 2 else []


def _limit(roof: dict[str, Any], margin: float = 0.95) -> str:
    return "arrivals" if float(roof["rps"]) < margin * float(roof["burst"]["rps"]) else "GPU"


def floor_table(checks: list[Check], runs: list[Run]) -> list[str]:
    """LoRA runs against their base run: the measured ratio and the roofline's ratio (the bytes floor: the adapters'
    rows on top of the same weights), on the trace and at saturation (burst)."""
    by_name = {run["name"]: run for run in runs}
    lines = ["| LoRA run | base run | measured | floor on the trace | floor at saturation | measured / floor "
             "(saturation) |", "|---|---|---|---|---|---|"]  # fmt: skip
    for check in (c for c in checks if c.target == "lora-vs-base"):
        lora, base = by_name[check.subject], by_name[check.reference]
        trace, burst = _ratio_of(lora, base, None), _ratio_of(lora, base, "burst")
        if trace is None or burst is None:
            continue
        lines.append(f"| {lora['name']} | {base['name']} | {check.value:.3f} | {trace:.3f} | {burst:.3f} "
                     f"| {check.value / burst:.3f} |")  # fmt: skip
    return lines if len(lines) > 2 else []


def _ratio_of(lora: Run, base: Run, key: str | None) -> float | None:
    top, bottom = _roof_rps(lora, key), _roof_rps(base, key)
    return top / bottom if top is not None and bottom else None


def steps_table(runs: list[Run]) -> list[str]:
    """Engine runs' steps by kind (graph decode, eager decode, graph and eager steps with prompts), compiles inside
    the clock, the share of the clock spent in steps (the rest: no request to step, e.g. waiting for arrivals or for
    adapter reads) and the requests that waited for their adapter's read from disk."""
    lines = ["| run | graph steps: n, mean ms (seqs) | eager decode steps | graph steps with prompts: n, mean ms "
             "(seqs, tokens) | mixed steps: n, mean ms (seqs, tokens) | Triton compiles in the run | clock in steps "
             "| requests read their adapter from disk |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for run in runs:
        m = run["metrics"]
        kinds = m.get("step_kinds")
        if not kinds:
            continue
        cells = [_step_cell(kinds.get(k), "mixed" in k) for k in ("graph", "decode", "mixed_graph", "mixed")]
        share = m.get("step_time_share")
        extra = [fmt(m.get("triton_compiles"), 0), "–" if share is None else f"{share:.0%}",
                 fmt(m.get("cold_adapter_requests"), 0)]  # fmt: skip
        lines.append(f"| {run['name']} | {' | '.join(cells + extra)} |")
    return lines if len(lines) > 2 else []


def served_steps_table(runs: list[Run]) -> list[str]:
    """Served runs' engine steps by kind, from the server's step counters around each run (client/steps.py):
    decode steps and steps with prompts, each with its count, mean time and mean batch, and the prompt tokens of a
    step with prompts; the share of each kind replayed as CUDA graphs; the seconds the GPU waited for the host
    between steps (their wall time beyond their time on the device, over both kinds: see _host_wait_cells), the
    steps' wall time against the run's, and the engine process's garbage-collection pauses (_gc_cell)."""
    lines = ["| run | decode steps: n, mean ms (requests) | steps with prompts: n, mean ms (requests, prompt tokens) "
             "| as CUDA graphs: decode, with prompts | GPU waiting for the host (for adapter copies), s "
             "| steps' wall s / run s | engine's GC pauses, s (full collections: n, s) |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for run in runs:
        steps = run["metrics"].get("steps")
        if not steps:
            continue
        decode, prompt = steps["decode"], steps["prompt"]
        cells = [_served_step_cell(decode, None), _served_step_cell(prompt, prompt.get("prompt_tokens_per_step"))]
        cells.append(", ".join(_share(kind.get("graph_share")) for kind in (decode, prompt)))
        cells += _host_wait_cells(decode, prompt, run["metrics"].get("duration_s"))
        cells.append(_gc_cell(steps.get("gc")))
        lines.append(f"| {run['name']} | {' | '.join(cells)} |")
    return lines if len(lines) > 2 else []


def first_token_path_table(runs: list[Run]) -> list[str]:
    """Served runs' first tokens as the client saw them and as the server did (client/server_ttft.py: arrival at the
    Triton model to the engine's first token, interpolated in its histogram's buckets); the difference is the
    path outside the engine. Of that path, the responder's part: the first response's delay from the engine's
    output to its send, and how busy the responder thread was (its busy time over the run)."""
    lines = ["| run | client TTFT p50 / p90 (s) | server TTFT p50 / p90 (s) | server's first tokens "
             "| first response's delay p50 / p90 (ms) | responder busy | client busy |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for run in runs:
        server = run["metrics"].get("server_ttft")
        if not server:
            continue
        client = run["metrics"].get("ttft_s") or {}
        cells = [
            f"{fmt(client.get('p50'), 3)} / {fmt(client.get('p90'), 3)}",
            f"{fmt(server.get('p50_s'), 3)} / {fmt(server.get('p90_s'), 3)}",
            f"{server['requests']:.0f}",
            *_responder_cells(run["metrics"]),
        ]
        lines.append(f"| {run['name']} | {' | '.join(cells)} |")
    return lines if len(lines) > 2 else []


def _responder_cells(m: dict[str, Any]) -> list[str]:
    responder = m.get("responder") or {}
    p50, p90 = responder.get("first_response_delay_p50_s"), responder.get("first_response_delay_p90_s")
    delay = f"{fmt(p50 and 1000 * p50, 1)} / {fmt(p90 and 1000 * p90, 1)}" if responder else "–"
    return [delay, _share(responder.get("busy_share")), _share(m.get("client_cpu_share"))]


def _host_wait_cells(decode: dict[str, Any], prompt: dict[str, Any], duration_s: float | None) -> list[str]:
    """The seconds all steps' wall time exceeded their device time (with, in brackets, the part the device waited
    for adapter copies, where the server counts it), and their wall seconds / the run's; "–" from a server without
    the wall counter.

    Only the sum over both kinds means something: with overlapped steps the host launches a step before it reads the
    previous one's tokens, so an eager step's launches delay that read, and the previous step's interval grows by as
    much as the eager step's shrinks (a step with prompts can show less wall time than device time)."""
    kinds = [kind for kind in (decode, prompt) if kind["steps"]]
    if any(kind.get("mean_wall_ms") is None for kind in kinds):
        return ["–", "–"]
    wall = sum(kind["steps"] * kind["mean_wall_ms"] for kind in kinds) / 1000
    device = sum(kind["steps"] * kind["mean_ms"] for kind in kinds) / 1000
    copies = [kind.get("copy_wait_s") for kind in (decode, prompt)]
    waited = f"{wall - device:.1f}"
    if all(c is not None for c in copies):
        waited += f" (adapter copies {sum(c for c in copies if c is not None):.2f})"
    return [waited, f"{wall:.1f} / {fmt(duration_s, 1)}"]


def _gc_cell(gc: dict[str, dict[str, float]] | None) -> str:
    """The seconds the engine process's garbage collections held the GIL in the run, all generations, and its full
    collections' count and seconds; "–" from a server without the counters. A pause stops the loop that launches
    the GPU's steps, but the GPU waits only for the part not hidden behind a step it already runs."""
    if not gc:
        return "–"
    total = sum(generation["seconds"] for generation in gc.values())
    full = gc["2"]
    return f"{total:.2f} ({full['collections']:.0f}, {full['seconds']:.2f})"


def _served_step_cell(kind: dict[str, Any], tokens: float | None) -> str:
    if not kind["steps"]:
        return "0"
    extra = f", {tokens:.0f}" if tokens is not None else ""
    return f"{kind['steps']}, {kind['mean_ms']:.1f} ({kind['mean_requests']:.0f}{extra})"


def _share(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


PHASE_COLUMNS = ("build", "wait", "launch", "sample", "other")


def phases_table(runs: list[Run]) -> list[str]:
    """Where each kind of step spends its host time (means, ms): building the batch, waiting for adapter copies,
    launching the forward, sampling (which waits for the GPU), and the rest (scheduling, outputs)."""
    header = " | ".join(f"{p} ms" for p in PHASE_COLUMNS)
    lines = [f"| run | step kind | mean ms | {header} |", "|---|---|---|" + "---|" * len(PHASE_COLUMNS)]
    for run in runs:
        for kind, tally in sorted((run["metrics"].get("step_kinds") or {}).items()):
            if "build_ms" not in tally:
                continue  # results of a harness that did not time the phases yet
            cells = " | ".join(f"{tally[f'{p}_ms']:.1f}" for p in PHASE_COLUMNS)
            lines.append(f"| {run['name']} | {kind} | {tally['mean_ms']:.1f} | {cells} |")
    return lines if len(lines) > 2 else []


def engine_host_table(runs: list[Run]) -> list[str]:
    """In-process runs' host work that grows with the adapters, inside the clock: the steps whose LoRA tables were
    built (their adapter list changed: built on the host and copied to the GPU) or reused, and the process's
    garbage collections, which stop the thread that launches the steps (the served runs' are in their steps
    table)."""
    lines = ["| run | engine steps | LoRA tables built / reused | GC pauses, s (full collections: n, s) "
             "| young collections (generations 0, 1) |",
             "|---|---|---|---|---|"]  # fmt: skip
    for run in runs:
        m = run["metrics"]
        gc = m.get("gc")
        if run["kind"] != "engine" or not gc:
            continue
        tables = m.get("lora_tables")
        built = f"{tables['built']} / {tables['reused']}" if tables else "–"
        young = gc["0"]["collections"] + gc["1"]["collections"]
        lines.append(f"| {run['name']} | {m.get('engine_steps', '–')} | {built} | {_gc_cell(gc)} | {young:.0f} |")
    return lines if len(lines) > 2 else []


def _step_cell(tally: dict[str, float] | None, tokens: bool) -> str:
    if not tally:
        return "–"
    extra = f", {tally['mean_tokens']:.0f}" if tokens else ""
    return f"{tally['steps']:.0f}, {tally['mean_ms']:.1f} ({tally['mean_seqs']:.0f}{extra})"


def checks_table(checks: list[Check]) -> list[str]:
    lines = ["| target | run | compared with | measured | goal | met |", "|---|---|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c.target} | {c.subject} | {c.reference} | {c.value:.3f} {c.unit} | "
                     f">= {c.goal:g} {c.unit} | {'yes' if c.passed else 'NO'} |")  # fmt: skip
    missing = [t for t in TARGETS if not any(c.target == t for c in checks)]
    for target in missing:
        lines.append(f"| {target} | not run | | | | |")
    return lines


def report(*results: Path) -> str:
    runs = load_runs(list(results))
    saturating = [r for r in runs if r.get("sweep", {}).get("role") != "load"]  # a load run's rate is its arrivals'
    checks = [c for check in CHECKS for c in check(saturating)]
    envs = sorted({(r["env"].get("commit"), r["env"].get("device"), r["env"].get("date_utc", "")[:10]) for r in runs})
    header = [f"# Results of {', '.join(p.name for p in results)}", ""]
    header += [f"- commit `{c}` on {d}, {day}" for c, d, day in envs]
    sections = [*header, "", "## Targets", "", *checks_table(checks), "", "## Runs", "", *runs_table(runs)]
    optional = (
        ("Headline: served, S-LoRA's method", headline_table(runs)),
        ("TTFT at fractions of capacity", sweep_table(runs)),
        ("Roofline of each run", roofline_table(runs)),
        ("LoRA runs against their base run and the bytes floor", floor_table(checks, runs)),
        ("Engine steps by kind", steps_table(runs)),
        ("Served runs' engine steps by kind", served_steps_table(runs)),
        ("Served runs' first tokens: client and server", first_token_path_table(runs)),
        ("Host time of a step, by phase", phases_table(runs)),
        ("Engine runs' host work: LoRA tables and garbage collections", engine_host_table(runs)),
        ("Tenant isolation: the noisy neighbour", noisy_table(runs)),
        ("Tenant isolation: overload", overload_table(runs)),
    )
    for title, table in optional:
        if table:
            sections += ["", f"## {title}", "", *table]
    return "\n".join(sections)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, help="write the markdown here (it is logged too)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    text = report(*args.results)
    if args.out:
        args.out.write_text(text + "\n")
    logger.info("%s", text)


if __name__ == "__main__":
    main()
