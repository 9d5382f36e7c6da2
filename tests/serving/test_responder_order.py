"""The responder's order of sends, without Triton: a stand-in for the stub's module records each response.

One engine step brings an output for every running request; a new request's first token must not wait behind
them: it goes out before the pending next tokens of running streams, and at most SEND_CHUNK responses after it
was queued. A request's queued outputs go out as one response, in order, and the last one is FINAL."""

from __future__ import annotations

import importlib
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from slora.backend.engine.outputs import RequestOutput
from slora.backend.serving.response_stream import ResponseStream


class _Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self.array = name, array


class _Response:
    def __init__(self, output_tensors: list[_Tensor] | None = None, error: Any = None) -> None:
        self.tensors = {t.name: t.array for t in output_tensors or []}
        self.error = error


class _Sender:
    def __init__(self, request_id: str, log: list[tuple[str, list[int], bool]]) -> None:
        self.request_id, self.log = request_id, log

    def send(self, response: _Response, flags: int = 0) -> None:
        self.log.append((self.request_id, response.tensors["output_ids"].tolist(), flags == 1))

    def is_cancelled(self) -> bool:
        return False


@pytest.fixture
def responder_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    stub = types.ModuleType("triton_python_backend_utils")
    stub.Tensor = _Tensor  # type: ignore[attr-defined]
    stub.InferenceResponse = _Response  # type: ignore[attr-defined]
    stub.TritonError = type("TritonError", (), {"INTERNAL": 13, "CANCELLED": 1, "UNAVAILABLE": 14})  # type: ignore[attr-defined]
    stub.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stub)
    names = [n for n in sys.modules if n.startswith("slora.backend.serving.triton")]
    for name in names:
        monkeypatch.delitem(sys.modules, name)
    yield importlib.import_module("slora.backend.serving.triton.responder")
    for name in [n for n in sys.modules if n.startswith("slora.backend.serving.triton")]:
        del sys.modules[name]  # built on the stand-in: not for other tests


def _track(responder: Any, request_id: str, log: list, started: bool) -> None:
    stream = ResponseStream(stream=True, arrival=time.monotonic(), outputs=frozenset({"output_ids"}))
    if started:
        stream.first_token_at = stream.last_token_at = time.monotonic()  # it has streamed tokens already
    responder.track(request_id, None, _Sender(request_id, log), stream)


def _queued(request_id: str, token: int, finished: bool = False) -> tuple[RequestOutput, float]:
    return RequestOutput(request_id, [token], finished=finished, finish_reason="length" if finished else None), 0.0


def test_a_first_token_goes_out_before_a_steps_next_tokens(responder_module: Any) -> None:
    responder, log = responder_module.Responder(check_s=60.0), []
    chunk = responder_module.SEND_CHUNK
    running = [f"run-{i}" for i in range(3 * chunk)]
    for rid in running:
        _track(responder, rid, log, started=True)
    _track(responder, "new-a", log, started=False)
    _track(responder, "new-b", log, started=False)
    responder._file([_queued(rid, 7) for rid in running] + [_queued("new-a", 5)])
    responder._send_some(chunk)
    assert log[0][0] == "new-a" and len(log) == chunk  # queued last, sent first
    responder._file([_queued("new-b", 6)])  # arrives while the step's responses are going out
    responder._send_some(chunk)
    assert log[chunk][0] == "new-b"  # waited for at most one chunk of them
    responder._send_some(None)
    assert sorted(rid for rid, _, _ in log) == sorted([*running, "new-a", "new-b"])  # each once


def test_a_requests_queued_outputs_go_out_as_one_response_in_order(responder_module: Any) -> None:
    responder, log = responder_module.Responder(check_s=60.0), []
    _track(responder, "r", log, started=False)
    responder._file([_queued("r", 1), _queued("r", 2), _queued("r", 3, finished=True)])
    responder._send_some(None)
    assert log == [("r", [1, 2, 3], True)] and responder.in_flight() == 0


def test_the_thread_sends_everything_queued_before_it_stops(responder_module: Any) -> None:
    responder, log = responder_module.Responder(check_s=60.0), []
    metrics = responder_module.NullMetrics()
    for i in range(40):
        _track(responder, f"r{i}", log, started=False)
    responder.serve(engine=None, metrics=metrics)
    for step in range(3):
        for i in range(40):
            last = step == 2
            responder.deliver(RequestOutput(f"r{i}", [step], finished=last, finish_reason="length" if last else None))
    responder.stop()
    tokens = {rid: [] for rid in (f"r{i}" for i in range(40))}
    finals = set()
    for rid, ids, final in log:
        tokens[rid] += ids
        if final:
            finals.add(rid)
    assert all(ids == [0, 1, 2] for ids in tokens.values()) and finals == set(tokens)
    assert responder.in_flight() == 0
