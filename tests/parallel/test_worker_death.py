"""A tensor-parallel worker that dies fails the requests in flight with an error naming it: in an engine process the
process exits with that reason and is started again (as when it dies itself); in the server's own process the
engine reports itself failed, so that the server reloads it."""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import time

import pytest

from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.outputs import RequestOutput
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.parallel.decoder import ShardedDecoder
from slora.backend.parallel.workers import TensorParallelError
from slora.backend.runtime.engine_process import EngineProcess
from slora.backend.runtime.engine_service import EngineService, LocalEngine
from slora.backend.runtime.messages import Submission
from tests.model_fixtures import ModelWithAdapters
from tests.runtime.callback_engine import CallbackEngine

LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [5, 9, 14, 2, 7]


def _config(model: ModelWithAdapters) -> EngineConfig:
    return EngineConfig(model=str(model.base), adapter_root=str(model.adapter_root), device="cpu", dtype="float32",
                        page_size=8, pool_bytes=4 << 20, max_model_len=512, tensor_parallel_size=2)  # fmt: skip


def _final(outputs: queue.Queue[RequestOutput], timeout: float = 60.0) -> RequestOutput:
    deadline = time.monotonic() + timeout
    while True:
        output = outputs.get(timeout=max(0.1, deadline - time.monotonic()))
        if output.finished:
            return output


def _kill_worker_while_running(service: EngineService, adapter: str | None) -> RequestOutput:
    """Start a long request, kill the worker once it streams, and return its final output."""
    outputs: queue.Queue[RequestOutput] = queue.Queue()
    service.submit(Submission("doomed", PROMPT, adapter, LONG), outputs.put)
    first = outputs.get(timeout=60)
    assert not first.finished, first.error
    os.kill(service.info.worker_pids[0], signal.SIGKILL)
    return _final(outputs)


def test_killed_worker_fails_requests_of_an_in_process_engine(llama: ModelWithAdapters) -> None:
    service = CallbackEngine(lambda sink: LocalEngine(LLMEngine(_config(llama)), sink))
    try:
        doomed = _kill_worker_while_running(service, "r3-all")
        assert doomed.finish_reason == "error"
        assert f"tensor-parallel worker rank 1 (pid {service.info.worker_pids[0]}) exited with code -9" in (
            doomed.error or ""
        )
        health = service.health()
        assert health.state == "failed" and "tensor-parallel worker rank 1" in health.reason
    finally:
        service.stop()


def test_killed_worker_restarts_the_engine_process(llama: ModelWithAdapters) -> None:
    engine = CallbackEngine(lambda sink: EngineProcess(_config(llama), sink))
    try:
        with_one = CallbackEngine(
            lambda sink: LocalEngine(LLMEngine(dataclasses.replace(_config(llama), tensor_parallel_size=1)), sink)
        )
        expected: queue.Queue[RequestOutput] = queue.Queue()
        with_one.submit(Submission("ref", PROMPT, "r8-mlp", SHORT), expected.put)
        reference = _tokens_of(expected)
        with_one.stop()
        old_pids = engine.info.worker_pids
        doomed = _kill_worker_while_running(engine, "r8-mlp")
        assert doomed.finish_reason == "error"
        assert f"tensor-parallel worker rank 1 (pid {old_pids[0]}) exited with code -9; restarting it" in (
            doomed.error or ""
        ), doomed.error
        deadline = time.monotonic() + 120
        while not engine.health().serving and time.monotonic() < deadline:
            time.sleep(0.2)
        assert engine.health().serving and engine.restarts == 1
        assert engine.info.worker_pids and engine.info.worker_pids != old_pids
        again: queue.Queue[RequestOutput] = queue.Queue()
        engine.submit(Submission("again", PROMPT, "r8-mlp", SHORT), again.put)
        assert _tokens_of(again) == reference
    finally:
        engine.stop()


def _tokens_of(outputs: queue.Queue[RequestOutput]) -> list[int]:
    tokens: list[int] = []
    while True:
        output = outputs.get(timeout=60)
        assert output.finish_reason != "error", output.error
        tokens += output.new_token_ids
        if output.finished:
            return tokens


def test_a_failed_step_on_rank_0_stops_the_workers(llama: ModelWithAdapters, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 leaving a forward half-way (here: a LoRA call raising) leaves the workers in a collective it will never
    reach: the group is given up, its workers stopped, and every later step refuses with the reason."""
    engine = LLMEngine(_config(llama))
    assert engine.parallel is not None
    workers = list(engine.parallel._workers)

    def broken(*args: object) -> None:
        raise ValueError("a bug in a LoRA call")

    assert isinstance(engine.model, ShardedDecoder)
    monkeypatch.setattr(engine.model.lora, "row", broken)
    engine.add_request(PROMPT, "r3-all", SHORT)
    with pytest.raises(TensorParallelError, match=r"rank 0's step failed \(ValueError: a bug in a LoRA call\)"):
        engine.step()
    assert all(w.process.poll() is not None for w in workers)
    with pytest.raises(TensorParallelError, match="rank 0's step failed"):
        engine.step()
    engine.parallel.close()
