"""A markdown report of a results file: every run, and each target of issue 5 checked against measured runs.

    python -m perf.report results.json [more-results.json ...] --out report.md

Targets (perf/RESULTS.md) and which runs each compares, all taken from the same results file:
    s1-2000       S1, n=2000, adapters on: throughput >= 24 req/s                   (engine and serving runs)
    n2000-vs-n5   throughput at n=2000 >= 0.95 x at n=5                              (same group and setting)
    lora-vs-base  adapters on >= 0.90 x base model alone, on the same trace file     (same group)
    vs-peft       ours >= 30 x HF PEFT on the same trace file                        (each PEFT run)
    served        through Triton >= 0.90 x in-process, same trace file, mode and kernels (each serving run)
Nothing is computed from numbers that were not measured: a target with no pair of runs is listed as not run.
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


CHECKS = (check_s1_2000, check_scaling, check_lora_vs_base, check_vs_peft, check_served)
TARGETS = ("s1-2000", "n2000-vs-n5", "lora-vs-base", "vs-peft", "served")


def _fmt(value: Any, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def runs_table(runs: list[Run]) -> list[str]:
    lines = [
        "| run | kind | n | mode | done | req/s | window req/s | out tok/s | TTFT p50 / p99 (s) | "
        "E2E p50 / p99 (s) | SLO | satisfaction |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        m = run["metrics"]
        lines.append(
            f"| {run['name']} | {run['kind']} | {_n(run)} | {_mode(run)} | {m['num_finished']}/{m['num_requests']} "
            f"| {_fmt(m['throughput_rps'])} | {_fmt(m.get('window_rps'))} | {_fmt(m['output_tok_s'], 0)} "
            f"| {_fmt(m['ttft_s']['p50'])} / {_fmt(m['ttft_s']['p99'])} | {_fmt(m['e2e_s']['p50'])} / "
            f"{_fmt(m['e2e_s']['p99'])} | {_fmt(m['slo_attainment'], 3)} | {_fmt(m['user_satisfaction'], 3)} |"
        )
    return lines


def steps_table(runs: list[Run]) -> list[str]:
    """Engine runs' steps by kind (graph decode, eager decode, mixed), compiles inside the clock, the share of the
    clock spent in steps (the rest: no request to step, e.g. waiting for arrivals or for adapter reads) and the
    requests that waited for their adapter's read from disk."""
    lines = ["| run | graph steps: n, mean ms (seqs) | eager decode steps | mixed steps: n, mean ms (seqs, tokens) "
             "| Triton compiles in the run | clock in steps | requests read their adapter from disk |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for run in runs:
        m = run["metrics"]
        kinds = m.get("step_kinds")
        if not kinds:
            continue
        graph, decode, mixed = (_step_cell(kinds.get(k), k == "mixed") for k in ("graph", "decode", "mixed"))
        share = m.get("step_time_share")
        extra = [_fmt(m.get("triton_compiles"), 0), "–" if share is None else f"{share:.0%}",
                 _fmt(m.get("cold_adapter_requests"), 0)]  # fmt: skip
        lines.append(f"| {run['name']} | {graph} | {decode} | {mixed} | {' | '.join(extra)} |")
    return lines if len(lines) > 2 else []


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
    checks = [c for check in CHECKS for c in check(runs)]
    envs = sorted({(r["env"].get("commit"), r["env"].get("device"), r["env"].get("date_utc", "")[:10]) for r in runs})
    header = [f"# Results of {', '.join(p.name for p in results)}", ""]
    header += [f"- commit `{c}` on {d}, {day}" for c, d, day in envs]
    steps = steps_table(runs)
    sections = [*header, "", "## Targets", "", *checks_table(checks), "", "## Runs", "", *runs_table(runs)]
    if steps:
        sections += ["", "## Engine steps by kind", "", *steps]
    phases = phases_table(runs)
    if phases:
        sections += ["", "## Host time of a step, by phase", "", *phases]
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
