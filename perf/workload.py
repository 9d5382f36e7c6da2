"""S-LoRA's synthetic workload: which adapter each request uses, when it arrives, and how long it is.

    python -m perf.workload -n 2000 --alpha 1 --rate 40 --cv 1 --duration 15 --prefix s1- --out s1-n2000.jsonl

Semantics (those of S-LoRA's benchmark trace generator, arXiv 2311.03285 section 7):
- Popularity: request j uses adapter floor(u_j * n), with u_j drawn from the power distribution on [0, 1]
  (density alpha * u^(alpha - 1)). alpha = 1 is uniform popularity; smaller alpha concentrates requests on the
  adapters of low index.
- Arrivals: a Gamma process of rate R and coefficient of variation cv: gaps ~ Gamma(shape 1/cv^2, scale
  cv^2/R), so cv = 1 is a Poisson process and larger cv is burstier. There are round(R * duration) requests.
- Lengths: input and output lengths uniform integers in [8, 512). Every request is greedy, ignores EOS and asks
  for exactly its output length (max_tokens).
- Prompts are random token ids in [first_token_id, vocab_size), so prompt lengths are exact whatever the
  tokenizer (ids below first_token_id are the special tokens of perf/make_model.py's tokenizer).

A trace is a JSONL file: one header line {"trace_config": {...}}, then one request per line. The same seed gives
the same file, byte for byte.

A benchmark run names a trace file and a mode, TRACE[@MODE] (RunSpec):
    lora    requests use the trace's adapters (default)
    base    the same requests on the base model alone (no adapters)
    single  the same requests, all on the trace's most requested adapter (the "one merged adapter" baseline:
            with random weights a merged adapter costs exactly the base model, so `base` is that figure and
            `single` shows the cost of computing one unmerged adapter)
"""

from __future__ import annotations

import argparse
import json
import logging
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MODES = ("lora", "base", "single")


@dataclass(frozen=True)
class TraceConfig:
    num_adapters: int  # 0: no adapters (every request on the base model)
    alpha: float = 1.0
    req_rate: float = 10.0  # requests per second, on average
    cv: float = 1.0
    duration: float = 60.0  # seconds; the trace holds round(req_rate * duration) requests
    input_range: tuple[int, int] = (8, 512)  # [low, high)
    output_range: tuple[int, int] = (8, 512)
    vocab_size: int = 32000
    first_token_id: int = 3
    adapter_prefix: str = "s1-"
    seed: int = 42

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_range", tuple(self.input_range))
        object.__setattr__(self, "output_range", tuple(self.output_range))
        if self.num_adapters < 0:
            raise ValueError(f"num_adapters must be >= 0, got {self.num_adapters}")
        for name in ("alpha", "req_rate", "cv", "duration"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("input_range", "output_range"):
            low, high = getattr(self, name)
            if not 1 <= low < high:
                raise ValueError(f"{name} must be [low, high) with 1 <= low < high, got {(low, high)}")
        if not 0 <= self.first_token_id < self.vocab_size:
            raise ValueError(f"first_token_id must be in [0, vocab_size), got {self.first_token_id}")

    @property
    def num_requests(self) -> int:
        return max(1, round(self.req_rate * self.duration))

    def adapter_name(self, index: int) -> str:
        return f"{self.adapter_prefix}{index:04d}"


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival: float  # seconds after the start of the replay
    adapter: str | None
    prompt_ids: tuple[int, ...]
    output_len: int

    @property
    def input_len(self) -> int:
        return len(self.prompt_ids)

    def sampling(self) -> dict[str, Any]:
        """The request's sampling parameters, in vLLM's names (what the engine and the server accept)."""
        return {"max_tokens": self.output_len, "temperature": 0.0, "ignore_eos": True}


@dataclass(frozen=True)
class Trace:
    config: TraceConfig
    requests: tuple[TraceRequest, ...]

    def __len__(self) -> int:
        return len(self.requests)

    def adapters(self) -> list[str]:
        """Distinct adapter names, most requested first."""
        counts = Counter(r.adapter for r in self.requests if r.adapter is not None)
        return [name for name, _ in counts.most_common()]

    def head(self, num_requests: int) -> Trace:
        """The first `num_requests` requests (a bounded prefix, for slow baselines)."""
        return Trace(self.config, self.requests[:num_requests])

    def with_adapter(self, adapter: str | None) -> Trace:
        """The same arrivals and lengths, every request on one adapter (None: on the base model alone)."""
        return Trace(self.config, tuple(replace(r, adapter=adapter) for r in self.requests))


def generate_trace(config: TraceConfig) -> Trace:
    rng = np.random.default_rng(config.seed)
    total = config.num_requests
    # Draw order is fixed (adapters, lengths, gaps, prompts) so a given seed always gives the same trace.
    popularity = rng.power(config.alpha, total)
    indices = np.minimum((popularity * max(config.num_adapters, 1)).astype(np.int64), max(config.num_adapters - 1, 0))
    input_lens = rng.integers(*config.input_range, size=total)
    output_lens = rng.integers(*config.output_range, size=total)
    shape = 1.0 / config.cv**2
    gaps = rng.gamma(shape, config.cv**2 / config.req_rate, size=total)
    arrivals = np.cumsum(gaps)
    requests = []
    for j in range(total):
        prompt = rng.integers(config.first_token_id, config.vocab_size, size=int(input_lens[j]))
        adapter = config.adapter_name(int(indices[j])) if config.num_adapters > 0 else None
        requests.append(
            TraceRequest(j, round(float(arrivals[j]), 6), adapter, tuple(prompt.tolist()), int(output_lens[j]))
        )
    return Trace(config, tuple(requests))


def save_trace(trace: Trace, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.write(json.dumps({"format": FORMAT_VERSION, "trace_config": asdict(trace.config)}) + "\n")
        for r in trace.requests:
            line = {"index": r.index, "arrival": r.arrival, "adapter": r.adapter, "output_len": r.output_len,
                    "prompt_ids": list(r.prompt_ids)}  # fmt: skip
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
    return path


def load_trace(path: Path) -> Trace:
    with path.open() as f:
        header = json.loads(f.readline())
        if header.get("format") != FORMAT_VERSION or "trace_config" not in header:
            raise ValueError(f"{path}: not a trace file of format {FORMAT_VERSION} (header {header!r:.200})")
        config = TraceConfig(**header["trace_config"])
        requests = []
        for line in f:
            if line.strip():
                d = json.loads(line)
                requests.append(
                    TraceRequest(d["index"], d["arrival"], d["adapter"], tuple(d["prompt_ids"]), d["output_len"])
                )
    return Trace(config, tuple(requests))


@dataclass(frozen=True)
class RunSpec:
    """One run of a benchmark: a trace file replayed in a mode (the module docstring)."""

    trace_path: Path
    mode: str = "lora"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")

    @classmethod
    def parse(cls, text: str) -> RunSpec:
        path, _, mode = text.partition("@")
        return cls(Path(path), mode or "lora")

    def load(self) -> Trace:
        return in_mode(load_trace(self.trace_path), self.mode)


def in_mode(trace: Trace, mode: str) -> Trace:
    """The trace as a run of `mode` replays it."""
    if mode == "base":
        return trace.with_adapter(None)
    if mode == "single":
        return trace.with_adapter(trace.adapters()[0] if trace.adapters() else None)
    return trace


def describe(trace: Trace) -> dict[str, Any]:
    """Summary numbers of a trace (logged, and stored with every result)."""
    reqs = trace.requests
    counts = Counter(r.adapter for r in reqs)
    return {
        "num_requests": len(reqs),
        "distinct_adapters": len([a for a in counts if a is not None]),
        "top_adapter_share": max(counts.values()) / len(reqs) if reqs else 0.0,
        "last_arrival_s": reqs[-1].arrival if reqs else 0.0,
        "mean_input_len": float(np.mean([r.input_len for r in reqs])) if reqs else 0.0,
        "mean_output_len": float(np.mean([r.output_len for r in reqs])) if reqs else 0.0,
        "total_output_tokens": sum(r.output_len for r in reqs),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--num-adapters", type=int, required=True, help="0: base model only")
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--rate", type=float, default=10.0, help="requests per second")
    parser.add_argument("--cv", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--input-range", type=int, nargs=2, default=(8, 512))
    parser.add_argument("--output-range", type=int, nargs=2, default=(8, 512))
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--prefix", default="s1-", help="adapter names are <prefix><index:04d>")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = TraceConfig(
        num_adapters=args.num_adapters, alpha=args.alpha, req_rate=args.rate, cv=args.cv, duration=args.duration,
        input_range=tuple(args.input_range), output_range=tuple(args.output_range), vocab_size=args.vocab_size,
        adapter_prefix=args.prefix, seed=args.seed,
    )  # fmt: skip
    trace = generate_trace(config)
    save_trace(trace, args.out)
    logger.info("wrote %s: %s", args.out, describe(trace))


if __name__ == "__main__":
    main()
