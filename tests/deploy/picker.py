"""What the endpoint picker (llm-d router's EPP) reads from a model server's metrics page, and how it scores LoRA
affinity: its rules restated in Python, to apply them to a live server with the configuration we ship.

    spec            "name" or "name{label=value,...}" (values quoted or not); a series matches when it has every
                    label of the spec with that value
    queue, running, KV specs
                    the matching series with the greatest sample timestamp (Triton writes none: the first one)
    LoRA spec       the matching series with the greatest *value* (the time of its update); its labels
                    running_lora_adapters / waiting_lora_adapters are comma-separated adapter names (blanks
                    trimmed, empty names dropped), max_lora an integer
    LoRA affinity   1.0 where the requested adapter runs; else 0.8 where running + waiting adapters are fewer than
                    max_lora; else 0.6 where it waits; else 0
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

_QUOTE_VALUES = re.compile(r'(\w+)\s*=\s*([^",}\s]+)')
_SPEC = re.compile(r"^\s*(\S+?)\s*(?:\{([^}]*)\})?\s*$")
_PAIR = re.compile(r'^\s*(\S+?)\s*=\s*"([^"]*)"\s*$')
_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


@dataclass(frozen=True)
class Spec:
    name: str
    labels: dict[str, str]

    def matches(self, labels: dict[str, str]) -> bool:
        return all(labels.get(key) == value for key, value in self.labels.items())


@dataclass(frozen=True)
class Sample:
    labels: dict[str, str]
    value: float
    timestamp: float | None


@dataclass
class EndpointState:
    """The picker's view of one endpoint (its Metrics struct)."""

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    active_models: set[str] = field(default_factory=set)
    waiting_models: set[str] = field(default_factory=set)
    max_active_models: int = 0


def parse_spec(text: str) -> Spec | None:
    """The picker's metric specification; None for an empty one (that metric is not read)."""
    if not text:
        return None
    match = _SPEC.match(_QUOTE_VALUES.sub(r'\1="\2"', text))
    if match is None or not _METRIC_NAME.match(match[1]):
        raise ValueError(f"not a valid metric specification: {text!r}")
    labels = {}
    block = (match[2] or "").strip()
    for pair in block.split(",") if block else []:
        label = _PAIR.match(pair)
        if label is None or not _LABEL_NAME.match(label[1]):
            raise ValueError(f"invalid label pair {pair!r} in {text!r}")
        labels[label[1]] = label[2]
    return Spec(match[1], labels)


def families(metrics_text: str) -> dict[str, list[Sample]]:
    """Every sample of a Prometheus text page, by metric name (as the picker's parser keys them)."""
    out: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            stamp = None if sample.timestamp is None else float(sample.timestamp)
            out.setdefault(sample.name, []).append(Sample(dict(sample.labels), sample.value, stamp))
    return out


def latest(spec: Spec, samples: dict[str, list[Sample]]) -> Sample | None:
    best: Sample | None = None
    for sample in samples.get(spec.name, []):
        stamp = sample.timestamp or 0.0
        if spec.matches(sample.labels) and (best is None or stamp > (best.timestamp or 0.0)):
            best = sample
    return best


def latest_lora(spec: Spec, samples: dict[str, list[Sample]]) -> Sample | None:
    best: Sample | None = None
    for sample in samples.get(spec.name, []):
        if spec.matches(sample.labels) and (best is None or sample.value > best.value):
            best = sample
    return best


def adapter_names(csv: str) -> set[str]:
    return {name.strip() for name in csv.split(",") if name.strip()}


def extract(engine: dict[str, Any], metrics_text: str) -> EndpointState:
    """The endpoint state from a metrics page, read with one engineConfigs entry of core-metrics-extractor."""
    samples = families(metrics_text)
    state = EndpointState()
    for key, attribute, kind in (("queuedRequestsSpec", "waiting", int), ("runningRequestsSpec", "running", int),
                                 ("kvUsageSpec", "kv_usage", float)):  # fmt: skip
        spec = parse_spec(engine.get(key, ""))
        if spec is None:
            continue
        sample = latest(spec, samples)
        if sample is None:
            raise LookupError(f"no series matches {engine[key]!r}")
        setattr(state, attribute, kind(sample.value))
    lora = parse_spec(engine.get("loraSpec", ""))
    sample = latest_lora(lora, samples) if lora is not None else None
    if sample is not None:
        state.active_models = adapter_names(sample.labels.get("running_lora_adapters", ""))
        state.waiting_models = adapter_names(sample.labels.get("waiting_lora_adapters", ""))
        if sample.labels.get("max_lora"):
            state.max_active_models = int(sample.labels["max_lora"])
    return state


def lora_affinity(state: EndpointState, model: str) -> float:
    if model in state.active_models:
        return 1.0
    if len(state.active_models) + len(state.waiting_models) < state.max_active_models:
        return 0.8
    if model in state.waiting_models:
        return 0.6
    return 0.0


def pick(states: dict[str, EndpointState], model: str) -> str:
    """The endpoint with the highest LoRA affinity for `model` (ties: the first)."""
    return max(states, key=lambda name: lora_affinity(states[name], model))


def engine_config(epp_config: dict[str, Any], engine_name: str) -> dict[str, Any]:
    """The engineConfigs entry named `engine_name` of the core-metrics-extractor plugin in an EPP config."""
    for plugin in epp_config["plugins"]:
        if plugin["type"] == "core-metrics-extractor":
            engines: Iterable[dict[str, Any]] = plugin.get("parameters", {}).get("engineConfigs", [])
            for engine in engines:
                if engine["name"] == engine_name:
                    return engine
    raise LookupError(f"the EPP config has no engine configuration named {engine_name!r}")
