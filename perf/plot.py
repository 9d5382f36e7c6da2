"""PNG plots of a results file (needs matplotlib; nothing else in perf/ does).

    python -m perf.plot results.json [more-results.json ...] --out-dir plots/

throughput.png   requests/s of every run, by kind (engine, serving, peft), with the 24 req/s target
scaling.png      requests/s against the number of adapters, one line per kind, setting and mode
latency.png      CDF of time to first token of every run, with the 6 s SLO
"""

from __future__ import annotations

import argparse
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

from perf.results import load_runs

logger = logging.getLogger(__name__)

TARGET_RPS = 24.0
COLORS = {"engine": "tab:blue", "serving": "tab:green", "peft": "tab:red"}


def plot_throughput(runs: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.35 * len(runs) + 1.5))
    names = [run["name"] for run in runs]
    values = [run["metrics"]["throughput_rps"] for run in runs]
    ax.barh(names, values, color=[COLORS.get(run["kind"], "gray") for run in runs])
    ax.axvline(TARGET_RPS, color="black", linestyle="--", linewidth=1, label=f"target {TARGET_RPS:g} req/s")
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.2f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.15 * max([*values, TARGET_RPS]))
    ax.set_xlabel("throughput (requests/s)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return _save(fig, out)


def plot_scaling(runs: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib.pyplot as plt

    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for run in runs:
        config = run["trace"]["config"]
        setting = config["adapter_prefix"].rstrip("-")
        key = f"{run.get('group', run['kind'])} {setting} {run['options'].get('mode', 'lora')}"
        lines[key].append((max(config["num_adapters"], 1), run["metrics"]["throughput_rps"]))
    markers = {"engine": "o", "serving": "s", "peft": "^"}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for key, points in sorted(lines.items()):
        points.sort()
        kind = next((k for k in markers if key.startswith(k)), "")
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=markers.get(kind, "o"), label=key)
    ax.axhline(TARGET_RPS, color="black", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("adapters in the trace (n)")
    ax.set_ylabel("throughput (requests/s)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    return _save(fig, out)


def plot_latency(runs: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for run in runs:
        ttft = sorted(t for t in (run.get("per_request") or {}).get("ttft", []) if t is not None)
        if ttft:
            total = len(run["per_request"]["ttft"])  # unfinished requests keep the curve below 1
            ax.plot(ttft, [(i + 1) / total for i in range(len(ttft))], label=run["name"], linewidth=1)
    ax.axvline(6.0, color="black", linestyle="--", linewidth=1, label="SLO 6 s")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=6)
    return _save(fig, out)


def _save(fig: Any, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return out


def plot_all(results: list[Path], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    runs = load_runs(results)
    if not runs:
        logger.warning("%s hold no runs: nothing to plot", results)
        return []
    written = [
        plot_throughput(runs, out_dir / "throughput.png"),
        plot_scaling(runs, out_dir / "scaling.png"),
        plot_latency(runs, out_dir / "latency.png"),
    ]
    logger.info("wrote %s", ", ".join(str(p) for p in written))
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    plot_all(args.results, args.out_dir)


if __name__ == "__main__":
    main()
