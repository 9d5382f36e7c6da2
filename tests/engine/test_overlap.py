"""Overlapped steps (EngineConfig.overlap_steps, backend/engine/inflight.py): each step is launched before the previous
step's tokens are read back, so the next step's inputs come from the device. The tokens, finish reasons and pool
state must be exactly those of the engine that reads every step's tokens before it schedules the next."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from slora.backend.config import EngineConfig
from slora.backend.engine.inflight import InflightStep
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.outputs import Completion, RequestOutput
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.runtime.engine_loop import EngineLoop
from slora.backend.runtime.output_sink import RequestCallbacks
from tests.engine import test_scheduling as scheduling
from tests.model_fixtures import ModelWithAdapters


def _engine(model: ModelWithAdapters, overlap: bool) -> LLMEngine:
    config = EngineConfig(model=str(model.base), adapter_root=str(model.adapter_root), device="cpu", dtype="float32",
                          page_size=4, pool_bytes=8 << 20, max_num_seqs=16, max_batch_tokens=48,
                          overlap_steps=overlap)  # fmt: skip
    return LLMEngine(config)


def _finishes(completions: list[Completion]) -> list[tuple[list[int], str]]:
    return [(c.token_ids, c.finish_reason) for c in completions]


def test_outputs_come_one_step_later(llama: ModelWithAdapters) -> None:
    engine = _engine(llama, overlap=True)
    request_id = engine.add_request([5, 9, 14], llama.adapters[0], SamplingParams(max_tokens=3, temperature=0.0))
    request = engine.requests[request_id]
    assert engine.step() == []  # the prompt's step is launched, its token not read yet
    assert request.num_inflight == 1 and request.num_computed == 3
    first = engine.step()  # launches the first decode (its input on the device), then reads the prompt's token
    assert [o.new_token_ids for o in first] == [request.output_ids] and request.num_inflight == 1
    outputs = first + engine.step() + engine.step()
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert not engine.has_unfinished() and engine._inflight is None  # the last token needed no further step
    engine.check_idle_integrity()


def test_mixed_finishes_match_the_synchronous_engine(llama: ModelWithAdapters) -> None:
    """Greedy and seeded random requests of several adapters, ending by length, by a stop token, by EOS, and
    arriving while others decode."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reference = _engine(llama, overlap=False)
    probe = reference.generate([[7, 3, 9]], None, greedy)[0].token_ids
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(probe[4],)),
        SamplingParams(max_tokens=12, temperature=0.0),  # EOS: a token the model makes, as below
        SamplingParams(max_tokens=9, temperature=0.9, top_k=20, top_p=0.9, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
    ]
    prompts = [[7, 3, 9], [11, 2], [7, 3, 9], [7, 3, 9], [4, 4, 8, 1], [6, 5]]
    adapters = [llama.adapters[0], None, None, None, llama.adapters[1], None]
    results = []
    for overlap in (False, True):
        engine = _engine(llama, overlap)
        engine.eos_token_ids = frozenset({probe[6]})
        results.append(_finishes(engine.generate(prompts, adapters, params)))
        engine.check_idle_integrity()
    assert results[0] == results[1]
    assert {reason for _, reason in results[0]} == {"length", "stop"}
    assert len(results[0][2][0]) < 12 and len(results[0][3][0]) < 12  # the stop token and EOS did end them


def test_abort_while_its_token_is_in_flight(llama: ModelWithAdapters) -> None:
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 14, 2], [3, 3, 3], [11, 12], [8, 1, 4, 4, 4]]
    adapters = [llama.adapters[0], None, llama.adapters[1], llama.adapters[0]]
    want = [c.token_ids for c in _engine(llama, overlap=False).generate(prompts, adapters, greedy)]
    engine = _engine(llama, overlap=True)
    ids = [engine.add_request(p, a, greedy) for p, a in zip(prompts, adapters)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    for _ in range(4):
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    victim = engine.requests[ids[2]]
    assert victim.num_inflight == 1
    final = engine.abort(ids[2])
    assert final is not None and final.finish_reason == "abort"
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id != ids[2]
            tokens[out.request_id] += out.new_token_ids
    engine.check_idle_integrity()
    assert [tokens[i] for i in (ids[0], ids[1], ids[3])] == [want[0], want[1], want[3]]
    assert tokens[ids[2]] == want[2][: len(tokens[ids[2]])]


def test_preemption_and_eviction_match(llama: ModelWithAdapters) -> None:
    """A pool too small for the batch: requests are preempted (some with a token in flight) and adapters evicted;
    the tokens are the roomy synchronous engine's (float32: a recomputation after preemption runs in other batch
    shapes, and bf16 rounding would differ with them)."""
    prompts, adapters = scheduling._workload(llama, 12, seed=1)
    roomy = scheduling._engine(llama, pages=2000, overlap_steps=False, dtype="float32")
    expected = roomy.generate(prompts, adapters, scheduling.GREEDY)
    tight = scheduling._engine(llama, pages=80, overlap_steps=True, dtype="float32")
    got = scheduling._run_checked(tight, prompts, adapters)
    assert tight.scheduler.num_preemptions > 0 and tight.cache.evictions > 0
    assert list(got.values()) == [c.token_ids for c in expected]


def test_stop_strings_match(tiny_text_model: Path) -> None:
    outputs = []
    for overlap in (False, True):
        engine = LLMEngine(EngineConfig(model=str(tiny_text_model), page_size=8, pool_bytes=64 << 20,
                                        overlap_steps=overlap))  # fmt: skip
        [free] = engine.generate(["Tell me"], None, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        stop = free.text[3:6]
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=(stop,))
        pieces = list(engine.stream("Tell me", None, params))
        outputs.append(("".join(p.text for p in pieces), pieces[-1].finish_reason, free.text))
    assert outputs[0] == outputs[1] and outputs[0][1] == "stop"
    assert outputs[0][0] == outputs[0][2][: outputs[0][2].index(outputs[0][2][3:6])]


def test_engine_loop_aborts_a_stream_mid_way(llama: ModelWithAdapters) -> None:
    """As a server runs it: the engine on its own thread, one stream cancelled by its client after two tokens."""
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 14, 2], [3, 3, 3], [11, 12]]
    adapters = [llama.adapters[0], None, llama.adapters[1]]
    want = [c.token_ids for c in _engine(llama, overlap=False).generate(prompts, adapters, greedy)]
    sink = RequestCallbacks()
    loop = EngineLoop(_engine(llama, overlap=True), sink)
    outputs: dict[int, list[RequestOutput]] = {i: [] for i in range(len(prompts))}
    finished = threading.Semaphore(0)
    ids: dict[int, str] = {}

    def collect(i: int) -> Callable[[RequestOutput], None]:
        def callback(output: RequestOutput) -> None:
            outputs[i].append(output)
            if i == 1 and len(outputs[i]) == 2:
                loop.abort(ids[1])
            if output.finished:
                finished.release()

        return callback

    loop.start()
    try:
        for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
            ids[i] = f"r{i}"
            sink.add(ids[i], collect(i))
            loop.submit(prompt, adapter, greedy, ids[i])
        for _ in prompts:
            assert finished.acquire(timeout=60)
        integrity = loop.call(lambda engine: engine.check_idle_integrity())
    finally:
        loop.stop()
    assert integrity is None
    tokens = {i: [t for o in outs for t in o.new_token_ids] for i, outs in outputs.items()}
    assert tokens[0] == want[0] and tokens[2] == want[2]
    assert outputs[1][-1].finish_reason == "abort" and [o.finished for o in outputs[1]].count(True) == 1
    assert tokens[1] == want[1][: len(tokens[1])] and 2 <= len(tokens[1]) < len(want[1])


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(llama: ModelWithAdapters, overlap: bool) -> None:
    """A forward that raises (with overlap: while the step before is still in flight) ends the requests in flight
    with an error; the pool is whole afterwards and later requests get the tokens they would have had."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 14, 2], [3, 3, 3]]
    adapters = [llama.adapters[0], None]
    want = [c.token_ids for c in _engine(llama, overlap=False).generate(prompts, adapters, greedy)]
    engine = _engine(llama, overlap)
    forward = engine.runner.model.forward
    calls = {"n": 0}

    def failing_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected device fault")
        return forward(*args, **kwargs)

    engine.runner.model.forward = failing_forward  # type: ignore[method-assign]
    sink = RequestCallbacks()
    loop = EngineLoop(engine, sink)
    finals: dict[str, RequestOutput] = {}
    done = threading.Semaphore(0)

    def callback(output: RequestOutput) -> None:
        if output.finished:
            finals[output.request_id] = output
            done.release()

    loop.start()
    try:
        first = [
            _submit(loop, sink, f"first-{i}", callback, p, a, greedy) for i, (p, a) in enumerate(zip(prompts, adapters))
        ]
        for _ in first:
            assert done.acquire(timeout=60)
        tokens: dict[str, list[int]] = {}

        def collect(output: RequestOutput) -> None:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            callback(output)

        second = [
            _submit(loop, sink, f"second-{i}", collect, p, a, greedy) for i, (p, a) in enumerate(zip(prompts, adapters))
        ]
        for _ in second:
            assert done.acquire(timeout=60)
        loop.call(lambda e: e.check_idle_integrity())
    finally:
        loop.stop()
    assert [finals[i].finish_reason for i in first] == ["error", "error"]
    assert "injected device fault" in (finals[first[0]].error or "")
    assert [tokens[i] for i in second] == want and [finals[i].finish_reason for i in second] == ["length"] * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: reading a step's tokens while later work runs")
def test_reading_a_step_does_not_wait_for_the_next() -> None:
    """A launched step's tokens are read as soon as its own sampling is done, not after the work queued behind it
    (the next step): otherwise nothing would overlap."""
    logits = torch.randn(8, 100, device="cuda")
    step = InflightStep(batch=None, tokens=torch.argmax(logits, dim=-1), requests=[])  # type: ignore[arg-type]
    torch.cuda._sleep(1_000_000_000)  # "the next step": ~0.5 s of GPU time queued behind the sampling
    later = torch.cuda.Event()
    later.record()
    step.read()
    assert not later.query(), "read() waited for the work queued after the step"
    assert step.host_tokens is not None and torch.equal(step.host_tokens, torch.argmax(logits, dim=-1).cpu())
    torch.cuda.synchronize()


def _submit(loop: EngineLoop, sink: RequestCallbacks, request_id: str, callback: Callable[[RequestOutput], None],
            prompt: list[int], adapter: str | None, sampling: SamplingParams) -> str:  # fmt: skip
    sink.add(request_id, callback)
    return loop.submit(prompt, adapter, sampling, request_id)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a step timed on the device's stream")
def test_a_step_is_timed_by_its_own_work_on_the_device_not_by_the_work_queued_before_it() -> None:
    """With overlapped steps a step is launched while the one before still runs: its time (step_clock.py) starts
    when the device reaches it."""
    torch.cuda._sleep(1_000_000_000)  # "the step before": ~0.5 s of GPU time queued ahead
    began = torch.cuda.Event(enable_timing=True)
    began.record()
    torch.cuda._sleep(100_000_000)  # the step's own work: ~0.05 s
    step = InflightStep(batch=None, tokens=torch.zeros(4, dtype=torch.int64, device="cuda"), requests=[],  # type: ignore[arg-type]
                        began=began)  # fmt: skip
    step.read()
    assert step.device_s is not None and 0.0 < step.device_s < 0.3, step.device_s
