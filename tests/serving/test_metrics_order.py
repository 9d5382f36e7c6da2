"""The metrics publisher's order within one engine snapshot: the LoRA label set (vllm:lora_requests_info, read by the
Gateway API endpoint picker together with the request gauges) is set before the running and waiting counts, so that
a scrape that sees a step's counts sees its adapters too. Triton's metric calls are recorded by a stand-in for its
stub module."""

from __future__ import annotations

import importlib
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest

from slora.backend.engine.outputs import EngineStats

Log = list[tuple[str, dict[str, str], str, float]]


def _stub(log: Log) -> types.ModuleType:
    class Metric:
        def __init__(self, family: str, labels: dict[str, str]) -> None:
            self.family, self.labels = family, labels

        def set(self, value: float) -> None:
            log.append((self.family, self.labels, "set", value))

        def increment(self, value: float) -> None:
            log.append((self.family, self.labels, "increment", value))

        def observe(self, value: float) -> None:
            log.append((self.family, self.labels, "observe", value))

    class MetricFamily:
        GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"

        def __init__(self, name: str, description: str, kind: str) -> None:
            self.name = name

        def Metric(self, labels: dict[str, str], buckets: object = None) -> Metric:  # noqa: N802 - Triton's name
            return Metric(self.name, labels)

    stub = types.ModuleType("triton_python_backend_utils")
    stub.MetricFamily = MetricFamily  # type: ignore[attr-defined]
    return stub


@pytest.fixture
def metrics_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Log]]:
    log: Log = []
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _stub(log))
    for name in [n for n in sys.modules if n.startswith("slora.backend.serving.triton")]:
        monkeypatch.delitem(sys.modules, name)
    yield importlib.import_module("slora.backend.serving.triton.metrics"), log
    for name in [n for n in sys.modules if n.startswith("slora.backend.serving.triton")]:
        del sys.modules[name]  # built on the stand-in: not for other tests


def _stats(running: list[str], waiting: list[str]) -> EngineStats:
    return EngineStats(pages_free=10, pages_kv=5, pages_adapter=1, pages_total=16, adapters_gpu=1, adapters_host=1,
                       adapters_known=2, running=len(running), waiting=len(waiting), adapter_loads=0,
                       adapter_evictions=0, preemptions=0, generated_tokens=0, finished_requests=0,
                       running_adapters=running, waiting_adapters=waiting)  # fmt: skip


def _published(log: Log, predicate: Any, timeout_s: float = 10.0) -> int:
    """The index in the log of the first entry that matches, once the metrics thread has written it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for i, entry in enumerate(list(log)):
            if predicate(entry):
                return i
        time.sleep(0.02)
    raise AssertionError(f"never published; the log: {log}")


def test_the_lora_label_set_is_published_before_the_request_counts(metrics_module: tuple[Any, Log]) -> None:
    metrics, log = metrics_module
    publisher = metrics.TritonMetrics(max_lora=2, lora_info=True, interval_s=0.01)
    try:
        publisher.update_stats(_stats(["alpha", "beta"], ["alpha"]))
        labels = _published(log, lambda e: e[0] == metrics.LORA_INFO_METRIC and e[2] == "set"
                            and e[1]["running_lora_adapters"] == "alpha,beta")  # fmt: skip
        running = _published(log, lambda e: e[0] == "slora_requests" and e[1] == {"state": "running"} and e[3] == 2)
        waiting = _published(log, lambda e: e[0] == "slora_requests" and e[1] == {"state": "waiting"} and e[3] == 1)
        assert labels < running and labels < waiting, log
        assert log[labels][1] == {"running_lora_adapters": "alpha,beta", "waiting_lora_adapters": "alpha",
                                  "max_lora": "2"}  # fmt: skip
    finally:
        publisher.close()
