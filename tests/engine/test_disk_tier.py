"""Adapters beyond host memory: ten thousand registered over a small host budget are served with the right tokens,
host memory stays bounded, a slow disk read does not hold up other requests' steps, a failed read fails its
request only."""

from __future__ import annotations

import gc
import os
import random
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from slora.backend.adapters.host_adapter import AdapterRef, HostAdapter
from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import READ_AHEAD_SHARE, LLMEngine
from slora.backend.engine.sampling_params import SamplingParams
from tests.factories import hf_reference
from tests.model_fixtures import ModelWithAdapters
from tests.reference import compare_greedy, hf_greedy

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
NUM_ADAPTERS = 10_000


@dataclass(frozen=True)
class ManyAdapters:
    root: Path
    source: dict[str, str]  # adapter name → the fixture adapter its files are hard links of


@pytest.fixture(scope="module")
def many(llama: ModelWithAdapters, tmp_path_factory: pytest.TempPathFactory) -> ManyAdapters:
    """NUM_ADAPTERS adapter folders, each hard links of one of the fixture's adapters (as perf/make_adapters.py
    makes its thousands)."""
    root = tmp_path_factory.mktemp("many")
    source: dict[str, str] = {}
    for i in range(NUM_ADAPTERS):
        name, origin = f"a{i:05d}", llama.adapters[i % len(llama.adapters)]
        folder = root / name
        folder.mkdir()
        for file in (llama.adapter_root / origin).iterdir():
            os.link(file, folder / file.name)
        source[name] = origin
    return ManyAdapters(root, source)


def _engine(model: ModelWithAdapters, root: Path, **options: Any) -> LLMEngine:
    """The disk tier as the tests read it: adapters read on demand (no preload, which is on by default on CUDA), in
    float32 (tokens are compared across engines whose batches differ, which bf16 on CUDA does not keep equal)."""
    options = {"preload_adapters": False, "dtype": "float32", **options}
    return LLMEngine(EngineConfig(model=str(model.base), adapter_root=str(root), page_size=8, **options))


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 150) for _ in range(rng.randint(3, 9))] for _ in range(n)]


class Watch:
    """Steps an engine to the end, checking after every step that host memory stays within its bounds."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokens: dict[str, list[int]] = {}
        self.reasons: dict[str, str | None] = {}
        self.errors: dict[str, str | None] = {}
        self.most_host_bytes = 0
        self.most_held_bytes = 0

    def run(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.engine.has_unfinished():
                return
            self.step()
        raise AssertionError("the engine did not finish")

    def step(self) -> None:
        for out in self.engine.step():
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                self.reasons[out.request_id], self.errors[out.request_id] = out.finish_reason, out.error
        self.check()

    def check(self) -> None:
        store, scheduler = self.engine.store, self.engine.scheduler
        assert store.host_bytes <= store.budget_bytes
        self.most_host_bytes = max(self.most_host_bytes, store.host_bytes)
        held = _held_image_bytes(self.engine)
        self.most_held_bytes = max(self.most_held_bytes, held)
        assert held <= store.budget_bytes + store.budget_bytes // READ_AHEAD_SHARE + _largest(self.engine)
        for request in [*scheduler.running, *scheduler.waiting]:
            assert request.adapter is None or type(request.adapter) is AdapterRef  # never the weights


def _largest(engine: LLMEngine) -> int:
    return max((r.nbytes for r in engine.store._refs.values()), default=0)


def _held_image_bytes(engine: LLMEngine) -> int:
    """Bytes of host images anything of the engine holds: the store's, the read-ahead window's, the pool's."""
    images: dict[int, int] = {}
    for adapter in list(engine.store._host.values()):
        images[id(adapter.image)] = adapter.nbytes
    for _, future in list(engine.scheduler.reads._reads.values()):
        if future.done() and future.exception() is None:
            images[id(future.result().image)] = future.result().nbytes
    for resident in engine.cache.resident():
        if not resident.host.image.is_meta:  # its copy is still in flight
            images[id(resident.host.image)] = resident.host.nbytes
    return sum(images.values())


def test_ten_thousand_adapters_over_a_small_host_budget(
    llama: ModelWithAdapters, many: ManyAdapters, tmp_path: Path
) -> None:
    reference = _engine(llama, llama.adapter_root, pool_bytes=8 << 20)
    one = max(reference.store.describe(name).nbytes for name in llama.adapters)
    budget = 24 * one  # a few dozen of ten thousand
    engine = _engine(llama, many.root, pool_bytes=4 << 20, host_budget_bytes=budget, max_num_seqs=32,
                     adapter_image_cache=str(tmp_path / "images"))  # fmt: skip
    assert engine.store.counts()[1] == NUM_ADAPTERS
    rng = random.Random(5)
    names = rng.sample(sorted(many.source), 400) + rng.choices(sorted(many.source)[:40], k=100)
    prompts = _prompts(len(names), seed=6)
    ids = [engine.add_request(p, n, GREEDY) for p, n in zip(prompts, names)]
    watch = Watch(engine)
    watch.run()
    assert all(watch.reasons[i] == "length" for i in ids), {watch.errors[i] for i in ids if watch.errors[i]}
    assert engine.store.host_evictions > 0 and engine.store.loads >= len(set(names))
    assert len(list((tmp_path / "images").glob("*.img"))) == len(llama.adapters), "hard links share an image"
    expected = reference.generate(prompts, [many.source[n] for n in names], GREEDY)
    assert [watch.tokens[i] for i in ids] == [c.token_ids for c in expected]
    engine.check_idle_integrity()
    assert all(r.host.image.is_meta for r in engine.cache.resident()), "the pool holds no host image"
    for k in range(3):  # spot checks against HF + PEFT itself
        name = names[k * 97]
        ref_model = hf_reference(llama.base, many.root / name)
        compare_greedy(watch.tokens[ids[k * 97]], hf_greedy(ref_model, prompts[k * 97], GREEDY.max_tokens), 1e-4)


def _lazy_intake(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests taken in as if host memory were full: every adapter read is the scheduler's."""
    monkeypatch.setattr(engine.store, "read_if_room", lambda ref: False)


def _slowed(engine: LLMEngine, name: str, seconds: float) -> None:
    """Reads of adapter `name` take `seconds` longer."""
    read = engine.store._loader

    def slow_read(adapter: str, path: Path, generation: int) -> HostAdapter:
        if adapter == name:
            time.sleep(seconds)
        return read(adapter, path, generation)

    engine.store._loader = slow_read


def test_a_slow_disk_read_does_not_hold_up_other_requests(
    llama: ModelWithAdapters, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(llama, llama.adapter_root, pool_bytes=8 << 20)
    engine.store.get("r1-qv")
    _lazy_intake(engine, monkeypatch)
    slow_s = 2.0
    _slowed(engine, "r16-all", slow_s)
    prompts = _prompts(6, seed=8)
    adapters: list[str | None] = ["r16-all", None, "r1-qv", None, "r1-qv", "r3-all"]
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, a, sampling) for p, a in zip(prompts, adapters)]
    watch = Watch(engine)
    start = time.perf_counter()
    steps: list[float] = []
    finished_at: dict[str, float] = {}
    while engine.has_unfinished():
        began = time.perf_counter()
        watch.step()
        steps.append(time.perf_counter() - began)
        finished_at.update({i: steps[-1] + began - start for i in watch.reasons if i not in finished_at})
    assert max(finished_at[i] for i in ids[1:]) < slow_s < finished_at[ids[0]], "the others did not wait for it"
    assert max(steps) < slow_s / 4, f"a step waited {max(steps):.2f} s for the disk"
    expected = _engine(llama, llama.adapter_root, pool_bytes=8 << 20).generate(prompts, adapters, sampling)
    assert [watch.tokens[i] for i in ids] == [c.token_ids for c in expected]
    engine.check_idle_integrity()


def test_a_failed_read_fails_its_requests_only(llama: ModelWithAdapters, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(llama, llama.adapter_root, pool_bytes=8 << 20)
    _lazy_intake(engine, monkeypatch)
    read = engine.store._loader

    def failing(name: str, path: Path, generation: int) -> HostAdapter:
        if name == "r5-ko":
            raise OSError("input/output error")
        return read(name, path, generation)

    engine.store._loader = failing
    adapters = ["r5-ko", "r1-qv", "r5-ko", None]
    ids = [engine.add_request(p, a, GREEDY) for p, a in zip(_prompts(4, seed=9), adapters)]
    watch = Watch(engine)
    watch.run()
    assert [watch.reasons[i] for i in ids] == ["rejected", "length", "rejected", "length"]
    assert "input/output error" in (watch.errors[ids[0]] or "")
    engine.check_idle_integrity()


def test_a_queued_request_holds_no_host_memory(llama: ModelWithAdapters) -> None:
    """Its adapter dropped from host memory while it waits, nothing keeps the image: the queue pins no memory."""
    engine = _engine(llama, llama.adapter_root, pool_bytes=8 << 20, max_num_seqs=1)
    engine.add_request(_prompts(1, seed=1)[0], None, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    rid = engine.add_request(_prompts(1, seed=2)[0], "r16-all", GREEDY)
    image = weakref.ref(engine.store.get("r16-all").image)
    engine.store._drop("r16-all")
    deadline = time.monotonic() + 5
    while image() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert image() is None and engine.requests[rid].adapter is not None
    watch = Watch(engine)
    watch.run()
    assert watch.reasons[rid] == "length"


def test_reads_follow_the_queue_within_the_read_ahead_window(
    llama: ModelWithAdapters, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(llama, llama.adapter_root, pool_bytes=8 << 20, max_num_seqs=1, adapter_read_ahead=3)
    _lazy_intake(engine, monkeypatch)
    order: list[str] = []
    gate = threading.Event()
    read = engine.store._loader

    def gated(name: str, path: Path, generation: int) -> HostAdapter:
        order.append(name)
        gate.wait(timeout=30)
        return read(name, path, generation)

    engine.store._loader = gated
    engine.add_request(_prompts(1, seed=3)[0], None, SamplingParams(max_tokens=20, ignore_eos=True))
    names = ["r8-mlp", "r12-qkv", "r2-down", "r5-ko", "r3-all"]
    ids = [engine.add_request(p, n, GREEDY) for n, p in zip(names, _prompts(len(names), seed=4))]
    engine.step()  # the base request runs; the batch is full: the queue only reads ahead
    deadline = time.monotonic() + 10
    while len(order) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.step()
    time.sleep(0.1)
    assert sorted(order) == sorted(names[:3]), "the head of the queue is read first, and the window bounds it"
    gate.set()
    watch = Watch(engine)
    watch.run()
    assert all(watch.reasons[i] == "length" for i in ids) and sorted(order) == sorted(names)
