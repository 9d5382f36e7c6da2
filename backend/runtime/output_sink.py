"""Where an engine hands its outputs: one sink per engine, not one callback per request.

Each process keeps one registry of the requests it serves: the engine's own `LLMEngine.requests`, and in the
Triton stub the responder's (request id → response sender). Outputs travel by request id between them, so the
layers in between (`EngineLoop`, `LocalEngine`, `EngineProcess`, the engine process's pump) hold no table of
their own. `deliver` is called on the engine's thread (or the receiver thread of an engine process) and must
return quickly. A caller that embeds the engine and wants one callback per request uses `RequestCallbacks`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from slora.backend.engine.outputs import RequestOutput, failed_output

logger = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]


class OutputSink(Protocol):
    def deliver(self, output: RequestOutput) -> None:
        """One output of one request (its last has `finished` set), in the order the engine produced them."""


class RequestSink(OutputSink, Protocol):
    """A sink that knows which requests it still waits on: an engine in another process can die with them."""

    def fail_all(self, error: Exception) -> None:
        """The engine is gone: end every request not finished yet with `error`, after what was delivered before."""


class RequestCallbacks:
    """A sink with one callback per request, for callers that embed the engine (tests, benchmarks, scripts): `add`
    a request's callback before submitting it; it is dropped after the request's final output."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: dict[str, OutputCallback] = {}

    def add(self, request_id: str, callback: OutputCallback) -> None:
        with self._lock:
            self._callbacks[request_id] = callback

    def deliver(self, output: RequestOutput) -> None:
        with self._lock:
            take = self._callbacks.pop if output.finished else self._callbacks.get
            callback = take(output.request_id, None)
        if callback is not None:
            callback(output)

    def fail_all(self, error: Exception) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, {}
        for request_id, callback in callbacks.items():
            callback(failed_output(request_id, error))


def deliver_each(sink: OutputSink, outputs: list[RequestOutput]) -> None:
    """Hand `outputs` to `sink`; one that raises is logged and the others still go (it is that request's fault)."""
    for output in outputs:
        try:
            sink.deliver(output)
        except Exception:
            logger.exception("delivering an output of request %s failed", output.request_id)
