"""The engine's steps over a window, from the step counters on a server's metrics port
(backend/engine/step_totals.py): scraped at both ends of the window, their difference gives each kind's steps,
mean time and mean batch, and the prompt tokens of a step that computed prompts. It tells where the time goes
(decode steps against steps with prompts, and how large those were) without a profiler on the server:
`slora-client steps --window 10`, and every served benchmark run's `steps` (perf/bench_serving.py,
perf/bench_tenants_served.py).

    before = scrape_settled("localhost:8002")
    ...  # the run
    summary = step_summary(before, scrape_settled("localhost:8002"))
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any

from slora.client.admin import metrics
from slora.client.server_ttft import parse_buckets

logger = logging.getLogger(__name__)

KINDS = ("decode", "prompt")
_SERIES = re.compile(
    r"^(slora_steps_total|slora_step_(?:seconds|wall_seconds|copy_wait_seconds|requests|graphs)_total)"
    r'\{kind="(\w+)"\}\s+(\S+)$'
)
_TOKENS = re.compile(r"^slora_step_prompt_tokens_total(?:\{\})?\s+(\S+)$")
_GC = re.compile(r'^(slora_gc_(?:seconds|collections)_total)\{generation="(\d)"\}\s+(\S+)$')
GC_GENERATIONS = ("0", "1", "2")


def parse_steps(text: str) -> dict[str, float]:
    """The step counters of a Prometheus text page: '<family>:<kind>' and 'prompt_tokens' → value; with the
    buckets of the server's first-token histogram (client/server_ttft.py), read from the same page."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if m := _SERIES.match(line):
            out[f"{m[1]}:{m[2]}"] = float(m[3])
        elif m := _TOKENS.match(line):
            out["prompt_tokens"] = float(m[1])
        elif m := _GC.match(line):
            out[f"{m[1]}:{m[2]}"] = float(m[3])
        elif bucket := parse_buckets(line):
            out[bucket[0]] = bucket[1]
    return out


def read_steps(metrics_url: str) -> dict[str, float]:
    """The step counters of the server at `metrics_url` (host:port); empty on a server from before them. Raises
    OSError (urllib's URLError is one) when the page cannot be read."""
    return parse_steps("\n".join(metrics(metrics_url)))


def scrape_steps(metrics_url: str | None) -> dict[str, float] | None:
    """read_steps for a benchmark run: None without a url, or when the page cannot be read or has no counters (the
    run goes on without them)."""
    if metrics_url is None:
        return None
    try:
        counters = read_steps(metrics_url)
    except OSError as exc:
        logger.warning("step counters not read from %s: %s", metrics_url, exc)
        return None
    if not counters:
        logger.warning("%s has no slora_steps_total: the run's steps are not reported", metrics_url)
        return None
    return counters


def scrape_settled(metrics_url: str | None, interval_s: float = 0.25, tries: int = 12) -> dict[str, float] | None:
    """scrape_steps once two reads `interval_s` apart agree: the server publishes its engine's statistics every
    0.1 s or so, so the last steps' counters come a moment after the last response (of the run, or of the warm-up
    before it)."""
    last = scrape_steps(metrics_url)
    for _ in range(tries):
        if last is None:
            return None
        time.sleep(interval_s)
        now = scrape_steps(metrics_url)
        if now == last:
            return now
        last = now
    return last


def step_summary(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """Per kind: steps, mean_ms, mean_wall_ms (their mean interval on the host; None from a server without the
    counter), copy_wait_s (the seconds the device waited ahead of them for adapter copies; None from a server
    without the counter), mean_requests and graph_share (of the steps, those replayed as CUDA graphs) over the
    window between the two scrapes; with prompt_tokens_per_step for steps with prompts. Under "gc": the engine
    process's garbage collections in the window, by generation ("0", "1", "2": full), {"seconds", "collections"}
    each; None from a server without the counters."""
    if before is None or after is None:
        return None

    def grew(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    out: dict[str, Any] = {}
    for kind in KINDS:
        steps = grew(f"slora_steps_total:{kind}")
        out[kind] = {
            "steps": int(steps),
            "mean_ms": 1000.0 * grew(f"slora_step_seconds_total:{kind}") / steps if steps else None,
            "mean_wall_ms": (
                1000.0 * grew(f"slora_step_wall_seconds_total:{kind}") / steps
                if steps and f"slora_step_wall_seconds_total:{kind}" in after
                else None
            ),
            "copy_wait_s": (
                grew(f"slora_step_copy_wait_seconds_total:{kind}")
                if f"slora_step_copy_wait_seconds_total:{kind}" in after
                else None
            ),
            "mean_requests": grew(f"slora_step_requests_total:{kind}") / steps if steps else None,
            "graph_share": grew(f"slora_step_graphs_total:{kind}") / steps if steps else None,
        }
    prompt_steps = out["prompt"]["steps"]
    out["prompt"]["prompt_tokens_per_step"] = grew("prompt_tokens") / prompt_steps if prompt_steps else None
    out["gc"] = (
        {g: _gc_growth(grew, g) for g in GC_GENERATIONS}
        if all(f"slora_gc_seconds_total:{g}" in after for g in GC_GENERATIONS)
        else None
    )
    return out


def _gc_growth(grew: Callable[[str], float], generation: str) -> dict[str, float]:
    return {
        "seconds": grew(f"slora_gc_seconds_total:{generation}"),
        "collections": int(grew(f"slora_gc_collections_total:{generation}")),
    }


def format_summary(summary: dict[str, Any] | None, window_s: float) -> str:
    """The summary as a small table (slora-client steps)."""
    if summary is None:
        return "no step counters on this metrics port (a server from before them?)\n"
    header = (f"{'kind':<8}{'steps':>8}{'mean ms':>10}{'wall ms':>10}{'requests':>10}{'prompt tokens':>15}"
              f"{'graphs %':>10}")  # fmt: skip
    lines = [f"steps in {window_s:g} s", header]
    for kind in KINDS:
        row = summary[kind]
        share = row["graph_share"]
        cells = [f"{row['steps']:>8}", _cell(row["mean_ms"], 10, ".1f"), _cell(row.get("mean_wall_ms"), 10, ".1f"),
                 _cell(row["mean_requests"], 10, ".1f"),
                 _cell(row.get("prompt_tokens_per_step"), 15, ".0f"),
                 _cell(None if share is None else 100 * share, 10, ".0f")]  # fmt: skip
        lines.append(f"{kind:<8}" + "".join(cells))
    return "\n".join(lines) + "\n"


def _cell(value: float | None, width: int, spec: str) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"
