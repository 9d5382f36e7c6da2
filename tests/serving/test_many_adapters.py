"""Ten thousand adapters registered with a host budget that holds a few of them, served through Triton: every
request completes without error and with the tokens of its own adapter, and the metrics show the disk tier at work.

Each adapter folder hard-links one demo adapter's weights but has a config of its own (its lora_alpha), so that
adapters sharing a weights file still give different outputs: a request served with another adapter's image, or
with one image cached for two configs, would show in its tokens."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from slora.backend.adapters.host_adapter import CONFIG_FILE, WEIGHTS_FILE
from slora.backend.engine.sampling_params import SamplingParams
from tests.serving.conftest import SERVE_DEVICE, _stop, launch
from tests.serving.triton_calls import Collected, run_streams, token_inputs, wait_for_metric

pytestmark = pytest.mark.server

NUM_ADAPTERS = 10_000
ALPHA_FACTORS = (0.5, 1.0, 1.5, 2.0, 3.0)  # times the demo adapter's own lora_alpha
HOST_ADAPTERS = 6  # the host budget, in adapters of the largest kind
REQUESTS = 160
MAX_TOKENS = 4


@dataclass(frozen=True)
class Variant:
    source: str  # the demo adapter whose weights the folder links
    alpha: float

    @property
    def name(self) -> str:
        return f"{self.source}-x{self.alpha:g}"


@dataclass(frozen=True)
class ManyAdapters:
    root: Path  # NUM_ADAPTERS folders
    variants: Path  # one folder per Variant, for the reference engine
    of: dict[str, Variant]  # adapter name → its variant


def _link_adapter(source: Path, config: dict[str, Any], folder: Path, alpha: float) -> None:
    """`folder`: a hard link of `source`'s weights, and `config` (the source's) with its lora_alpha scaled."""
    folder.mkdir()
    os.link(source / WEIGHTS_FILE, folder / WEIGHTS_FILE)
    (folder / CONFIG_FILE).write_text(json.dumps({**config, "lora_alpha": config["lora_alpha"] * alpha}))


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> ManyAdapters:
    from slora.backend.adapters.demo import DEMO_ADAPTERS, write_demo_adapters

    base = tmp_path_factory.mktemp("demo")
    write_demo_adapters("default", base)
    root, variants = base.parent / "many", base.parent / "variants"
    root.mkdir()
    variants.mkdir()
    configs = {a.name: json.loads((base / a.name / CONFIG_FILE).read_text()) for a in DEMO_ADAPTERS}
    of: dict[str, Variant] = {}
    for i in range(NUM_ADAPTERS):
        variant = Variant(DEMO_ADAPTERS[i % len(DEMO_ADAPTERS)].name, ALPHA_FACTORS[(i // 4) % len(ALPHA_FACTORS)])
        of[f"tenant-{i:05d}"] = variant
        _link_adapter(base / variant.source, configs[variant.source], root / f"tenant-{i:05d}", variant.alpha)
    for variant in set(of.values()):
        _link_adapter(base / variant.source, configs[variant.source], variants / variant.name, variant.alpha)
    return ManyAdapters(root, variants, of)


@pytest.fixture(scope="module")
def reference(many: ManyAdapters) -> Any:
    from slora.backend.config import EngineConfig
    from slora.backend.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model="default", device=SERVE_DEVICE, dtype="float32",
                                  adapter_root=str(many.variants), max_model_len=256, pool_bytes=64 << 20))  # fmt: skip


@dataclass(frozen=True)
class Served:
    grpc_url: str
    metrics_url: str
    images: Path  # the adapter image cache


@pytest.fixture(scope="module")
def served(many: ManyAdapters, reference: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    largest = max(reference.store.describe(v.name).nbytes for v in set(many.of.values()))
    root = tmp_path_factory.mktemp("many-server")
    # The disk tier as a GPU host runs it by default: converted images cached on local disk, host memory filled at
    # start, and requests whose adapter copy is not issued yet passed over at admission.
    options = {"host_budget_bytes": HOST_ADAPTERS * largest, "adapter_image_cache": root / "images",
               "preload_adapters": "true", "admit_when_copied": "true"}  # fmt: skip
    launched = launch(
        root, "--adapter-dir", str(many.root), "--max-model-len", "256", "--max-num-seqs", "16", "--pool-bytes",
        "64MiB", *[arg for key, value in options.items() for arg in ("--engine-option", f"{key}={value}")],
    )  # fmt: skip
    try:
        yield Served(launched.grpc_url, launched.metrics_url, root / "images")
    finally:
        _stop(launched.process, launched.log)


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 4000) for _ in range(rng.randint(4, 24))] for _ in range(count)]


def test_ten_thousand_adapters_over_a_small_host_budget_are_served(
    many: ManyAdapters, reference: Any, served: Served
) -> None:
    wait_for_metric(served.metrics_url, 'slora_adapters{tier="disk"}', lambda v: v == NUM_ADAPTERS)
    rng = random.Random(11)
    names = sorted(many.of)
    chosen = rng.sample(names, REQUESTS - 40) + rng.choices(names[:12], k=40)  # mostly cold, some hot
    rng.shuffle(chosen)
    prompts = _prompts(REQUESTS, seed=12)
    requests = {
        f"r{i}": token_inputs(prompt, max_tokens=MAX_TOKENS, adapter=name, sampling={"temperature": 0})
        for i, (prompt, name) in enumerate(zip(prompts, chosen))
    }
    groups = [dict(list(requests.items())[k::4]) for k in range(4)]  # four clients at once
    results: dict[str, Collected] = {}
    with ThreadPoolExecutor(len(groups)) as pool:
        for part in pool.map(lambda group: run_streams(served.grpc_url, "slora", group, timeout_s=600), groups):
            results.update(part)

    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    expected = reference.generate(prompts, [many.of[n].name for n in chosen], [greedy] * REQUESTS)
    for i, (name, completion) in enumerate(zip(chosen, expected)):
        got = results[f"r{i}"]
        assert got.error is None, f"r{i} ({name}): {got.error}"
        assert got.final and got.finish_reason == completion.finish_reason, f"r{i} ({name})"
        assert got.token_ids == completion.token_ids, f"r{i} ({name}, {many.of[name]})"

    # Each distinct adapter was read from disk, and host memory held only a few of them at a time.
    wait_for_metric(served.metrics_url, "slora_adapter_disk_reads_total", lambda v: v >= len(set(chosen)))
    wait_for_metric(served.metrics_url, "slora_adapter_host_evictions_total", lambda v: v > 0)
    # Folders with the same config bytes and weights file share one converted image; different configs never do.
    images = len(list(served.images.glob("*.img")))
    assert len({many.of[n] for n in chosen}) <= images <= len(set(many.of.values())), images
