"""One results file for a whole benchmark session: {"runs": [run, ...]}, each run self-describing.

A run records what was measured and how: its name, kind (engine | serving | peft), the trace's configuration and
summary, the options, the environment (commit, date, GPU, library versions) and the metrics of perf/metrics.py,
with (engine and serving runs) `roofline` and `roofline_fraction` (perf/roofline.py); a served run of a rate sweep
also has `sweep` (perf/bench_serving.py).
Several processes append to the same file one after the other (perf/offline/run_lab.sh), so that one file holds every
figure of a session side by side.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

from perf.workload import Trace, describe

logger = logging.getLogger(__name__)


def environment() -> dict[str, Any]:
    """Commit, date and the machine, for RESULTS.md."""
    import torch

    env: dict[str, Any] = {
        "commit": os.environ.get("SLORA_COMMIT") or _git_commit(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": gpu_name() or "cpu",
        "cpu_count": os.cpu_count(),
    }
    for module in ("triton", "transformers", "peft", "tritonclient"):
        env[module] = _version(module)
    return env


def gpu_name() -> str | None:
    """The name torch gives this machine's GPU (None without one)."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def trace_info(trace: Trace, path: Path | None = None) -> dict[str, Any]:
    return {"path": str(path) if path else None, "config": asdict(trace.config), **describe(trace)}


def make_run(
    name: str, kind: str, trace: dict[str, Any], options: dict[str, Any], metrics: dict[str, Any], **extra: Any
) -> dict[str, Any]:
    return {"name": name, "kind": kind, "trace": trace, "options": options, "env": environment(),
            "metrics": metrics, **extra}  # fmt: skip


def append_runs(path: Path, runs: list[dict[str, Any]]) -> None:
    """Add runs to the results file (created if missing); nothing is dropped: a repeated name gets '#2', '#3'."""
    data = load_results(path) if path.is_file() else {"runs": []}
    names = {r.get("name") for r in data["runs"]}
    for run in runs:
        base, k = run["name"], 1
        while run["name"] in names:
            k += 1
            run = {**run, "name": f"{base}#{k}"}
        names.add(run["name"])
        data["runs"].append(run)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)
    logger.info("results: %d run(s) written to %s (%d in all)", len(runs), path, len(data["runs"]))


def load_results(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise ValueError(f"{path}: not a results file (expected {{'runs': [...]}})")
    return data


def load_runs(paths: list[Path]) -> list[dict[str, Any]]:
    """The runs of several results files (e.g. of several GPU calls), in order; repeated names get '#2', '#3'."""
    runs: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for path in paths:
        for run in load_results(path)["runs"]:
            seen[run["name"]] = seen.get(run["name"], 0) + 1
            if seen[run["name"]] > 1:
                run = {**run, "name": f"{run['name']}#{seen[run['name']]}"}
            runs.append(run)
    return runs


def headline(run: dict[str, Any]) -> str:
    """One log line per run: the figures RESULTS.md asks for."""
    m = run["metrics"]
    ttft = m["ttft_s"]
    return (
        f"{run['name']}: {m['num_finished']}/{m['num_requests']} done in {m['duration_s']:.1f}s, "
        f"{m['throughput_rps']:.2f} req/s ({_fmt(m.get('window_rps'))} in window), "
        f"{m['output_tok_s']:.0f} out tok/s, ttft p50 {_fmt(ttft['p50'])}s p99 {_fmt(ttft['p99'])}s, "
        f"slo {m['slo_attainment']:.3f}, satisfaction {m['user_satisfaction']:.3f}, "
        f"roofline fraction {_fmt(m.get('roofline_fraction'), 3)}"
    )


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=5).stdout.strip()  # fmt: skip
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # not installed, or no metadata
        return None
