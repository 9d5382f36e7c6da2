"""Per-step timeline of a torch.profiler chrome trace: is a step bound by the host or by the device?

StepProfiler wraps each profiled step in a `slora_step` annotation. Every kernel (or copy) on the device is tied to
the host call that launched it by the trace's correlation ids, so each device operation belongs to the step whose
host span holds its launch. For each step this gives:

- host_ms: the step's host span (engine.step from start to end);
- span_ms: from the step's first device operation's start to its last one's end, on the busiest stream;
- busy_ms: the time that stream was running the step's operations (the union of their intervals);
- idle_ms: span minus busy: gaps inside the step where the device waited for the host's next launch. An eager step
  whose idle time is a large share of its span is bound by the host's launches;
- graph: whether the step launched a CUDA graph;
- kernels_ms / kernels_busy_ms: by kernel name, the summed durations, and the share of busy time each kernel holds
  alone (the part of its interval past every operation that started before it). They differ where launches overlap:
  a kernel launched with programmatic dependent launch (PDL: the LoRA expand after its shrink) starts while its
  predecessor runs and waits for it, so its duration also counts the predecessor's tail. The busy shares add up to
  busy_ms.

    python -m perf.trace_steps trace.json.gz     # the table, and a summary by kind (graph or eager steps)
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import logging
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STEP_ANNOTATION = "slora_step"
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
GRAPH_LAUNCH = "cudaGraphLaunch"


@dataclass
class StepTimeline:
    index: int
    host_ms: float
    graph: bool = False
    span_ms: float = 0.0
    busy_ms: float = 0.0
    other_streams_ms: float = 0.0  # device time of the step's operations on other streams (copies)
    launches: int = 0  # device operations of the step
    kernels_ms: dict[str, float] = field(default_factory=dict)  # busiest stream's summed durations by kernel name
    kernels_busy_ms: dict[str, float] = field(default_factory=dict)  # its busy time held alone, by kernel name

    @property
    def idle_ms(self) -> float:
        return self.span_ms - self.busy_ms

    @property
    def kind(self) -> str:
        return "graph" if self.graph else "eager"


def load_trace(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace: dict[str, Any] = json.load(f)
    return trace


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length, in ms, of the union of (start, end) intervals given in µs."""
    total = 0.0
    end = float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total / 1e3


def busy_shares(ops: list[tuple[str, float, float]]) -> dict[str, float]:
    """Busy ms by name of (name, start, end) operations given in µs: each holds the part of its interval past the end
    of every operation that started before it, so that overlapping operations are not counted twice."""
    shares: dict[str, float] = defaultdict(float)
    end = float("-inf")
    for name, start, stop in sorted(ops, key=lambda op: (op[1], op[2])):
        shares[name] += max(0.0, stop - max(start, end)) / 1e3
        end = max(end, stop)
    return dict(shares)


def step_timelines(trace: dict[str, Any]) -> list[StepTimeline]:
    """One StepTimeline per `slora_step` annotation of the trace, in order."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    steps = sorted((e for e in events if e.get("name") == STEP_ANNOTATION and e.get("cat") != "gpu_user_annotation"),
                   key=lambda e: e["ts"])  # fmt: skip
    starts = [float(s["ts"]) for s in steps]
    timelines = [StepTimeline(i, float(s["dur"]) / 1e3) for i, s in enumerate(steps)]

    def owner(ts: float) -> int | None:
        i = bisect.bisect_right(starts, ts) - 1
        if i < 0 or ts > starts[i] + float(steps[i]["dur"]):
            return None
        return i

    launched_by: dict[int, int] = {}  # correlation id -> step
    for e in events:
        if e.get("cat") not in ("cuda_runtime", "cuda_driver"):
            continue
        step = owner(float(e["ts"]))
        if step is None:
            continue
        if e.get("name") == GRAPH_LAUNCH:
            timelines[step].graph = True
        correlation = e.get("args", {}).get("correlation")
        if correlation is not None:
            launched_by[correlation] = step
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("cat") in DEVICE_CATEGORIES:
            step = launched_by.get(e.get("args", {}).get("correlation"))
            if step is not None:
                by_step[step].append(e)
    for step, ops in by_step.items():
        _fill(timelines[step], ops)
    return timelines


def _fill(timeline: StepTimeline, ops: list[dict[str, Any]]) -> None:
    streams = Counter(_stream(e) for e in ops)
    main = streams.most_common(1)[0][0]
    on_main = [e for e in ops if _stream(e) == main]
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in on_main]
    timeline.launches = len(ops)
    timeline.span_ms = (max(stop for _, stop in intervals) - min(start for start, _ in intervals)) / 1e3
    timeline.busy_ms = union_ms(intervals)
    timeline.other_streams_ms = sum(float(e["dur"]) for e in ops if _stream(e) != main) / 1e3
    kernels: dict[str, float] = defaultdict(float)
    for e in on_main:
        kernels[e["name"]] += float(e["dur"]) / 1e3
    timeline.kernels_ms = dict(kernels)
    timeline.kernels_busy_ms = busy_shares([(e["name"], start, stop) for e, (start, stop) in zip(on_main, intervals)])


def _stream(event: dict[str, Any]) -> Any:
    return event.get("args", {}).get("stream", event.get("tid"))


def summary(timelines: list[StepTimeline], top: int = 8) -> str:
    """A table of every step, then by kind: mean host, span, busy and idle ms, and the kernels that hold most busy
    time (with their summed durations, larger where launches overlap)."""
    lines = ["| step | kind | host ms | device span ms | busy ms | idle ms | other streams ms | device ops |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for t in timelines:
        lines.append(f"| {t.index} | {t.kind} | {t.host_ms:.2f} | {t.span_ms:.2f} | {t.busy_ms:.2f} | {t.idle_ms:.2f} "
                     f"| {t.other_streams_ms:.2f} | {t.launches} |")  # fmt: skip
    for kind in ("graph", "eager"):
        group = [t for t in timelines if t.kind == kind and t.launches]
        if not group:
            continue
        lines.append("")
        lines.append(f"{kind} steps ({len(group)}): mean host {_mean(group, 'host_ms'):.2f} ms, device span "
                     f"{_mean(group, 'span_ms'):.2f}, busy {_mean(group, 'busy_ms'):.2f}, idle "
                     f"{_mean(group, 'idle_ms'):.2f} ms")  # fmt: skip
        busy, run = _per_step(group, "kernels_busy_ms"), _per_step(group, "kernels_ms")
        for name, ms in sorted(busy.items(), key=lambda item: -item[1])[:top]:
            lines.append(f"  {ms:8.3f} ms a step busy ({run[name]:.3f} running)  {name[:80]}")
    return "\n".join(lines)


def _per_step(group: list[StepTimeline], attr: str) -> dict[str, float]:
    """Mean ms a step, by kernel name, of a by-name attribute of the steps."""
    totals: dict[str, float] = defaultdict(float)
    for t in group:
        for name, ms in getattr(t, attr).items():
            totals[name] += ms / len(group)
    return totals


def _mean(group: list[StepTimeline], attr: str) -> float:
    return statistics.fmean(getattr(t, attr) for t in group)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="chrome trace of torch.profiler (.json or .json.gz)")
    parser.add_argument("--top", type=int, default=8, help="kernels listed for each kind of step")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.info("%s", summary(step_timelines(load_trace(args.trace)), args.top))


if __name__ == "__main__":
    main()
