"""The trace generator has S-LoRA's semantics: power-law popularity, Gamma arrivals, uniform lengths, seeded."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from perf.workload import TraceConfig, describe, generate_trace, load_trace, main, save_trace


def test_same_seed_same_file_other_seed_other_trace(tmp_path: Path) -> None:
    config = TraceConfig(num_adapters=50, req_rate=20, duration=5, seed=7)
    a = save_trace(generate_trace(config), tmp_path / "a.jsonl").read_bytes()
    b = save_trace(generate_trace(config), tmp_path / "b.jsonl").read_bytes()
    c = save_trace(generate_trace(TraceConfig(num_adapters=50, req_rate=20, duration=5, seed=8)), tmp_path / "c")
    assert a == b
    assert c.read_bytes() != a


def test_round_trip_and_cli(tmp_path: Path) -> None:
    main(["-n", "10", "--rate", "5", "--duration", "4", "--vocab-size", "100", "--prefix", "x-", "--out",
          str(tmp_path / "t.jsonl")])  # fmt: skip
    trace = load_trace(tmp_path / "t.jsonl")
    assert trace == generate_trace(trace.config)
    assert len(trace) == 20
    assert all(r.adapter is not None and r.adapter.startswith("x-") for r in trace.requests)


def test_lengths_prompts_and_sampling() -> None:
    trace = generate_trace(TraceConfig(num_adapters=3, req_rate=100, duration=10, vocab_size=500))
    inputs = [r.input_len for r in trace.requests]
    outputs = [r.output_len for r in trace.requests]
    assert min(inputs) >= 8 and max(inputs) < 512 and min(outputs) >= 8 and max(outputs) < 512
    assert np.mean(inputs) == pytest.approx(259.5, rel=0.05)
    assert all(3 <= t < 500 for r in trace.requests for t in r.prompt_ids)
    assert trace.requests[0].sampling() == {
        "max_tokens": trace.requests[0].output_len,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    arrivals = [r.arrival for r in trace.requests]
    assert arrivals == sorted(arrivals)


def _top_share(alpha: float, n: int = 100) -> float:
    trace = generate_trace(TraceConfig(num_adapters=n, alpha=alpha, req_rate=200, duration=20, input_range=(8, 9)))
    counts = Counter(r.adapter for r in trace.requests)
    top_decile = sum(c for _, c in counts.most_common(n // 10))
    return top_decile / len(trace)


def test_alpha_one_is_uniform_and_small_alpha_concentrates() -> None:
    uniform = _top_share(1.0)
    assert uniform < 0.16  # 10% of adapters get about 10% of requests
    assert _top_share(0.3) > 0.45  # u^(1/0.3) < 0.1 with probability 0.1^0.3 = 0.50
    assert _top_share(0.1) > 0.7  # 0.1^0.1 = 0.79
    trace = generate_trace(TraceConfig(num_adapters=100, alpha=0.1, req_rate=200, duration=20, input_range=(8, 9)))
    assert trace.adapters()[0] == "s1-0000"  # low indices are the popular ones


@pytest.mark.parametrize("cv", [1.0, 3.0])
def test_gamma_arrivals_have_rate_and_cv(cv: float) -> None:
    trace = generate_trace(TraceConfig(num_adapters=1, req_rate=50, cv=cv, duration=200, input_range=(8, 9)))
    gaps = np.diff([0.0] + [r.arrival for r in trace.requests])
    assert len(trace) == 10000
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


def test_base_only_single_adapter_and_prefix() -> None:
    trace = generate_trace(TraceConfig(num_adapters=0, req_rate=10, duration=2))
    assert all(r.adapter is None for r in trace.requests)
    lora = generate_trace(TraceConfig(num_adapters=10, req_rate=10, duration=2))
    single = lora.with_adapter("s1-0003")
    assert {r.adapter for r in single.requests} == {"s1-0003"}
    assert [r.prompt_ids for r in single.requests] == [r.prompt_ids for r in lora.requests]
    assert len(lora.head(5)) == 5
    assert describe(lora)["num_requests"] == 20


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_adapters": -1},
        {"num_adapters": 1, "alpha": 0},
        {"num_adapters": 1, "cv": 0},
        {"num_adapters": 1, "input_range": (8, 8)},
        {"num_adapters": 1, "vocab_size": 2},
    ],  # fmt: skip
)
def test_invalid_config_names_the_field(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(k for k in kwargs if k != "num_adapters"), "num_adapters")):
        TraceConfig(**kwargs)
