"""Per-request timings and the summary every benchmark reports (engine, server, PEFT alike).

Times are seconds since the start of the replay; a request's latency counts from its scheduled arrival, so time
spent queued (in the client, the server or the engine) is included, as in S-LoRA's benchmark.

Metrics:
- throughput_rps: finished requests / duration, duration = start of the replay to the last finish (S-LoRA's
  "throughput"); output_tok_s and total_tok_s (prompt + output) over the same duration.
- window_*: the same rates measured only inside [window_start, last arrival], window_start a fraction of the
  last arrival (default 0.25): the steady state of a saturated system, without the ramp-up or the drain.
- ttft (time to first token), tpot (per request: (last token - first token) / (tokens - 1)), itl (gaps between
  consecutive streamed chunks, divided by the tokens in the later chunk), e2e (arrival to last token):
  mean, p50, p90, p99 over finished requests.
- slo_attainment: share of all requests whose first token came within the SLO (6 s); requests that failed or did
  not finish count as misses.
- user_satisfaction: S-LoRA's metric: mean over all requests of 1 - (ttft / 6 s)^2 when ttft < 6 s, else 0
  (failed or unfinished requests: 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

SLO_TTFT_S = 6.0
PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    index: int
    adapter: str | None
    input_len: int
    output_len: int  # requested (max_tokens)
    arrival: float
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    finish_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None

    def add_chunk(self, time: float, num_tokens: int) -> None:
        if num_tokens > 0:
            self.chunk_times.append(time)
            self.chunk_tokens.append(num_tokens)

    def settle_tokens(self, total: int) -> None:
        """The server's own count of this request's output tokens (OpenAI usage): tokens a chunk's text does not
        show (special tokens decode to nothing) are added to the last chunk, so num_output is exact."""
        missing = total - self.num_output
        if missing > 0 and self.chunk_tokens:
            self.chunk_tokens[-1] += missing

    def finish(self, time: float, reason: str | None, error: str | None = None) -> None:
        self.finish_time = time
        self.finish_reason = reason
        self.error = error

    @property
    def num_output(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ok(self) -> bool:
        return self.finish_time is not None and self.error is None and self.num_output > 0

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.arrival if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return self.finish_time - self.arrival if self.finish_time is not None else None

    @property
    def tpot(self) -> float | None:
        if self.num_output < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.num_output - 1)

    def itl(self) -> list[float]:
        gaps: list[float] = []
        for i in range(1, len(self.chunk_times)):
            k = self.chunk_tokens[i]
            gaps += [(self.chunk_times[i] - self.chunk_times[i - 1]) / k] * k
        return gaps


def satisfaction(ttft: float | None, slo: float = SLO_TTFT_S) -> float:
    """S-LoRA's user satisfaction of one request: 1 - (ttft / slo)^2 below the SLO, else 0."""
    if ttft is None or ttft >= slo:
        return 0.0
    return 1.0 - (ttft / slo) ** 2


def attained(ttft: float | None, slo: float = SLO_TTFT_S) -> float:
    return 1.0 if ttft is not None and ttft < slo else 0.0


def distribution(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    array = np.asarray(values, dtype=np.float64)
    return {"mean": float(array.mean()), **{f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES}}


def summarize(
    records: list[RequestRecord],
    duration: float | None = None,
    window_fraction: float = 0.25,
    slo_s: float = SLO_TTFT_S,
) -> dict[str, Any]:
    """The metrics of one run (see the module docstring); JSON-ready. `duration` defaults to the last finish;
    `slo_s` is the first-token SLO that attainment and satisfaction count against (S-LoRA's by default)."""
    done = [r for r in records if r.ok]
    if duration is None:
        duration = max((r.finish_time or 0.0 for r in done), default=0.0)
    out_tokens = sum(r.num_output for r in done)
    in_tokens = sum(r.input_len for r in done)
    ttfts = [r.ttft for r in records]
    summary: dict[str, Any] = {
        "num_requests": len(records),
        "num_finished": len(done),
        "num_failed": sum(1 for r in records if r.error is not None),
        "num_unfinished": sum(1 for r in records if r.finish_time is None),
        "num_short": sum(1 for r in done if r.num_output != r.output_len),  # fewer/more tokens than asked
        "duration_s": duration,
        "throughput_rps": len(done) / duration if duration > 0 else 0.0,
        "output_tok_s": out_tokens / duration if duration > 0 else 0.0,
        "total_tok_s": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        **_window(records, window_fraction),
        "ttft_s": distribution([r.ttft for r in done if r.ttft is not None]),
        "tpot_s": distribution([r.tpot for r in done if r.tpot is not None]),
        "itl_s": distribution([g for r in done for g in r.itl()]),
        "e2e_s": distribution([r.e2e for r in done if r.e2e is not None]),
        "e2e_per_output_token_s": distribution([r.e2e / r.num_output for r in done if r.e2e is not None]),
        "slo_ttft_s": slo_s,
        "slo_attainment": float(np.mean([attained(t, slo_s) for t in ttfts])) if records else 0.0,
        "user_satisfaction": float(np.mean([satisfaction(t, slo_s) for t in ttfts])) if records else 0.0,
    }
    return summary


def _window(records: list[RequestRecord], fraction: float) -> dict[str, Any]:
    last_arrival = max((r.arrival for r in records), default=0.0)
    start, end = fraction * last_arrival, last_arrival
    if end - start <= 0:
        return {"window_s": [start, end], "window_rps": None, "window_output_tok_s": None}
    finished = sum(1 for r in records if r.ok and start <= (r.finish_time or -1.0) < end)
    tokens = sum(k for r in records for t, k in zip(r.chunk_times, r.chunk_tokens) if start <= t < end)
    return {
        "window_s": [start, end],
        "window_rps": finished / (end - start),
        "window_output_tok_s": tokens / (end - start),
    }


def per_request(records: list[RequestRecord]) -> dict[str, list[Any]]:
    """Compact per-request columns (for CDF plots and later analysis); None where a request did not finish."""

    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 5)

    ordered = sorted(records, key=lambda r: r.index)
    return {
        "index": [r.index for r in ordered],
        "arrival": [rounded(r.arrival) for r in ordered],
        "ttft": [rounded(r.ttft) for r in ordered],
        "e2e": [rounded(r.e2e) if r.ok else None for r in ordered],
        "num_output": [r.num_output for r in ordered],
    }
