"""Run an LLMEngine in a thread of its own, for servers: thread-safe submit / abort, outputs to one sink.

Requests are checked and their adapters loaded in the caller's thread (`LLMEngine.prepare`), so a bad request
fails at once in its own thread and a slow adapter load never stalls the batch. The sink (output_sink.py) is
called on the engine thread after each step and must return quickly (hand the output to another thread or send
it). The loop keeps no table of requests: the engine's own (`LLMEngine.requests`) says what is in flight.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.outputs import EngineStats, failed_output
from slora.backend.engine.request import Request
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.errors import EngineOverloadedError
from slora.backend.runtime.output_sink import OutputSink, deliver_each
from slora.backend.runtime.queues import take_batch

logger = logging.getLogger(__name__)

T = TypeVar("T")
MAX_BATCH = 4096  # inbox items taken between two steps
# The statistics are rebuilt at most this often while requests run, and after the step that leaves none: with
# thousands of requests waiting, building them (adapter and tenant lists) and sending them to the server's process
# after every step of a few milliseconds is host time the steps wait for, and Triton's metrics publish them every
# 0.1 s anyway.
STATS_INTERVAL_S = 0.05


@dataclass
class _Submit:
    request: Request


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: Future


class EngineLoop:
    def __init__(self, engine: LLMEngine, sink: OutputSink, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._sink = sink
        self._inbox: queue.Queue[_Submit | _Abort | _Call | None] = queue.Queue()
        self._idle_wait_s = idle_wait_s
        self._thread = threading.Thread(target=self._run, name="slora-engine", daemon=True)
        self._stopping = threading.Event()
        self._stats = engine.stats()
        self._stats_due = 0.0
        self._beat = time.monotonic()
        self.stats_listeners: list[Callable[[EngineStats], None]] = []  # each new EngineStats, on the engine thread

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left, stop the thread and wait for it."""
        self._stopping.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    def submit(
        self,
        prompt: Any,
        adapter: str | None = None,
        sampling: SamplingParams | dict[str, Any] | None = None,
        request_id: str | None = None,
        detokenize: bool = True,
        tenant: str | None = None,
        priority: int = 0,
        ttft_slo_s: float | None = None,
    ) -> str:
        """Check and queue a request (LLMEngine.prepare says what each argument does); raises its error here, in
        the caller's thread. Its outputs go to the sink; returns its id."""
        if self._stopping.is_set():
            raise EngineOverloadedError("the engine is shutting down")
        request = self.engine.prepare(prompt, adapter, sampling, request_id, detokenize, tenant, priority, ttft_slo_s)
        queued = self._stats.waiting + self._inbox.qsize()
        if queued >= self.engine.config.max_waiting:
            raise EngineOverloadedError(
                f"{queued} requests are waiting (max_waiting={self.engine.config.max_waiting}); try again later"
            )
        self._inbox.put(_Submit(request))
        return request.request_id

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def call(self, fn: Callable[[LLMEngine], T], timeout: float | None = 60.0) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        future: Future = Future()
        self._inbox.put(_Call(fn, future))
        return future.result(timeout)

    def stats(self) -> EngineStats:
        """The statistics as of a step at most STATS_INTERVAL_S ago, or of the last one if none runs (no wait)."""
        return self._stats

    def beat_age(self) -> float:
        """Seconds since the loop last went round (a step, or an idle wait of idle_wait_s): how a watchdog tells a
        hung engine thread from a busy one."""
        return time.monotonic() - self._beat

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._beat = time.monotonic()
            self._drain(block=not self.engine.has_unfinished())
            if self._stopping.is_set():
                break
            self._step()
        for request_id in list(self.engine.requests):
            self._handle(_Abort(request_id))

    def _drain(self, block: bool) -> None:
        items, _ = take_batch(self._inbox, MAX_BATCH, timeout=self._idle_wait_s if block else 0)
        for item in items:
            self._handle(item)

    def _handle(self, item: _Submit | _Abort | _Call) -> None:
        if isinstance(item, _Submit):
            self._submit(item)
        elif isinstance(item, _Abort):
            output = self.engine.abort(item.request_id)
            if output is not None:
                deliver_each(self._sink, [output])
        elif not item.future.set_running_or_notify_cancel():
            return
        else:
            try:
                item.future.set_result(item.fn(self.engine))
            except Exception as exc:  # handed to the caller, who asked for it
                item.future.set_exception(exc)

    def _submit(self, item: _Submit) -> None:
        try:
            self.engine.submit(item.request)
        except Exception as exc:  # refused by the engine (duplicate id, full queue): tell this request only
            deliver_each(self._sink, [failed_output(item.request.request_id, exc)])

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the requests in flight")
            failure = RuntimeError(f"engine failure: {exc}")
            outputs = [
                failed_output(rid, failure) for rid in list(self.engine.requests) if self.engine.abort(rid) is not None
            ]
        deliver_each(self._sink, outputs)
        now = time.monotonic()
        if now >= self._stats_due or not self.engine.has_unfinished():
            self._stats = self.engine.stats()
            self._stats_due = now + STATS_INTERVAL_S
            for listener in self.stats_listeners:
                listener(self._stats)
