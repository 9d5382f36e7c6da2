"""admit_when_copied: a request whose adapter copy into the pool is not issued yet is passed over at admission
while other requests run (instead of the step waiting for the copy on the host), keeps its place at the head of the
queue, and is admitted once the copy is issued; its tokens are those of an engine that waits for every copy."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from slora.backend.config import EngineConfig, admit_when_copied
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.engine.scheduler import SchedulerOutput
from slora.backend.executor.batch import ScheduledSeq
from tests.model_fixtures import ModelWithAdapters

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 29, 41, 53], [7, 19, 31], [11, 23, 35, 47], [13, 25]]


def _engine(model: ModelWithAdapters, **options: Any) -> LLMEngine:
    """Admission at every step (with CUDA graphs, the default admits every other step), which the steps below count."""
    return LLMEngine(EngineConfig(model=str(model.base), adapter_root=str(model.adapter_root), page_size=8,
                                  pool_bytes=8 << 20, admit_interval=1, **options))  # fmt: skip


@contextmanager
def held_copies(engine: LLMEngine) -> Iterator[threading.Event]:
    """Copies into the pool wait (on the copier's thread) until the yielded event is set; set on exit."""
    release = threading.Event()
    copier = engine.cache.copier
    copy = copier._copy

    def gated(*args: Any) -> Any:
        release.wait(timeout=30)
        return copy(*args)

    copier._copy = gated  # type: ignore[method-assign]
    try:
        yield release
    finally:
        release.set()
        copier._copy = copy  # type: ignore[method-assign]


def _names(requests: Any) -> list[str]:
    return [r.request_id for r in requests]


def test_request_with_uncopied_adapter_is_passed_over_then_admitted(llama: ModelWithAdapters) -> None:
    adapters = [None, "r3-all", None, "r3-all"]
    expected = _engine(llama).generate(PROMPTS, adapters, GREEDY)
    engine = _engine(llama, admit_when_copied=True)
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    first = engine.add_request(PROMPTS[0], adapters[0], GREEDY)
    step()
    with held_copies(engine) as release:
        held = engine.add_request(PROMPTS[1], adapters[1], GREEDY)
        behind = engine.add_request(PROMPTS[2], adapters[2], GREEDY)
        same = engine.add_request(PROMPTS[3], adapters[3], GREEDY)
        step()  # the held adapter's requests are passed over; the one behind them goes first
        assert _names(engine.scheduler.running) == [first, behind]
        assert _names(engine.scheduler.waiting) == [held, same], "passed-over requests keep their order"
        resident = engine.cache.get(engine.store.get("r3-all").key)
        assert resident is not None and resident.refcount == 0 and not resident.copy_issued
        step()
        assert _names(engine.scheduler.waiting) == [held, same]
        release.set()
        resident.ready.result(timeout=30)  # type: ignore[union-attr]
        step()
    assert _names(engine.scheduler.running)[2:] == [held, same] and not engine.scheduler.waiting
    while engine.has_unfinished():
        step()
    assert [tokens[i] for i in (first, held, behind, same)] == [c.token_ids for c in expected]
    engine.check_idle_integrity()
    assert engine.cache.loads == 1


def _step_while_copy_held(engine: LLMEngine, prompt: list[int], hold_s: float = 0.2) -> tuple[str, float]:
    """Add a request for r3-all (not yet in the pool) and take one step while its copy is held for hold_s:
    (its id, the step's seconds)."""
    with held_copies(engine) as release:
        timer = threading.Timer(hold_s, release.set)
        timer.start()
        request = engine.add_request(prompt, "r3-all", GREEDY)
        began = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - began
        timer.join()
    return request, elapsed


def test_an_idle_engine_waits_for_the_copy(llama: ModelWithAdapters) -> None:
    """With nothing else to run, passing over would leave the step empty: the step waits for the copy instead."""
    engine = _engine(llama, admit_when_copied=True)
    request, elapsed = _step_while_copy_held(engine, PROMPTS[0])
    assert _names(engine.scheduler.running) == [request] and elapsed >= 0.15


def test_off_the_step_waits_for_the_copy(llama: ModelWithAdapters) -> None:
    engine = _engine(llama, admit_when_copied=False)
    first = engine.add_request(PROMPTS[0], None, GREEDY)
    engine.step()
    held, elapsed = _step_while_copy_held(engine, PROMPTS[1])
    assert _names(engine.scheduler.running) == [first, held] and elapsed >= 0.15


def test_auto_is_on_for_cuda_only() -> None:
    auto = EngineConfig()
    assert admit_when_copied(auto, torch.device("cuda")) and not admit_when_copied(auto, torch.device("cpu"))
    assert admit_when_copied(EngineConfig(admit_when_copied=True), torch.device("cpu"))
    assert not admit_when_copied(EngineConfig(admit_when_copied=False), torch.device("cuda"))
    assert EngineConfig.from_dict({"admit_when_copied": "false"}).admit_when_copied is False


@pytest.mark.parametrize("passes", [1, 3])
def test_passes_a_step_are_bounded_by_prefetch_adapters(llama: ModelWithAdapters, passes: int) -> None:
    """Each passed-over request may start an adapter load: admission stops after prefetch_adapters of them."""
    engine = _engine(llama, admit_when_copied=True, prefetch_adapters=passes)
    engine.add_request(PROMPTS[0], None, GREEDY)
    engine.step()
    names = ["r1-qv", "r3-all", "r5-ko", "r8-mlp", "r12-qkv"]
    with held_copies(engine):
        for i, name in enumerate(names):
            engine.add_request(PROMPTS[i % len(PROMPTS)], name, GREEDY)
        engine.scheduler._admit_waiting(_busy_output(engine), budget=1000)
        assert engine.cache.loads == passes
        assert len(engine.scheduler.waiting) == len(names)


def _busy_output(engine: LLMEngine) -> SchedulerOutput:
    """A step that already runs the engine's first running request (so that passing over is allowed)."""
    out = SchedulerOutput()
    out.seqs.append(ScheduledSeq(engine.scheduler.running[0], 1))
    return out
