"""The engine loop rebuilds its statistics at most every STATS_INTERVAL_S while requests run, and after the step
that leaves none, so that what a scraper reads once the engine is idle is exact."""

from __future__ import annotations

import threading

import pytest

from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.outputs import EngineStats, RequestOutput
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.runtime import engine_loop
from slora.backend.runtime.engine_loop import EngineLoop
from slora.backend.runtime.output_sink import RequestCallbacks
from tests.model_fixtures import ModelWithAdapters

TOKENS = 12


def test_stats_wait_for_their_interval_while_busy_and_are_exact_once_idle(
    llama: ModelWithAdapters, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_loop, "STATS_INTERVAL_S", 3600.0)
    config = EngineConfig(model=str(llama.base), adapter_root=str(llama.adapter_root), device="cpu", dtype="float32",
                          page_size=4, pool_bytes=8 << 20, max_num_seqs=4)  # fmt: skip
    engine = LLMEngine(config)
    busy_steps = 0
    step = engine.step

    def counted_step() -> list[RequestOutput]:
        nonlocal busy_steps
        busy_steps += engine.has_unfinished()
        return step()

    engine.step = counted_step  # type: ignore[method-assign]
    sink = RequestCallbacks()
    loop = EngineLoop(engine, sink)
    built_busy: list[EngineStats] = []
    built_idle: list[EngineStats] = []
    loop.stats_listeners.append(lambda stats: (built_busy if engine.has_unfinished() else built_idle).append(stats))
    finished = threading.Event()
    sink.add("r", lambda output: finished.set() if output.finished else None)
    loop.start()
    try:
        loop.submit([5, 9, 14, 2], llama.adapters[0], SamplingParams(max_tokens=TOKENS, temperature=0.0,
                                                                     ignore_eos=True), "r")  # fmt: skip
        assert finished.wait(60)
        final = loop.call(lambda _engine: loop.stats())  # the loop has finished the step that delivered it
    finally:
        loop.stop()
    # a rebuild at most at the first step (none came before it), none after: the interval had not passed
    assert busy_steps >= TOKENS and len(built_busy) <= 1
    assert final.finished_requests == 1 and final.running == 0 and final.waiting == 0
    assert final.generated_tokens == TOKENS and any(stats is final for stats in built_idle)
