"""The responder thread of the `slora` model: engine outputs → Triton responses, and client cancellation → abort.

The responder is the engine's sink (runtime/output_sink.py): the engine's thread only queues outputs here (it must
be quick), and the responder's table of requests in flight (request id → response sender) is the only one in this
process. This thread owns every in-flight request's response sender, so no sender is ever used by two threads.
Each request ends with exactly one response flagged FINAL: its last tokens, or an error (engine failure, abort,
cancellation). Outputs of one request that queued up while this thread was busy go out as one response: under load
there are fewer sends (each costs a message to the server and holds the GIL the engine thread needs), and none is
ever delayed.

Cancellation: a client that cancels its gRPC stream or drops its HTTP SSE connection marks the request
cancelled in the server. In-flight requests are checked every `check_s` (each check is a cheap message to the
server); a cancelled one is aborted in the engine, which frees its pages at once. When the server is stopping
(drain.py), every request in flight is aborted and ends with a FINAL response whose finish_reason is "abort".
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import triton_python_backend_utils as pb_utils

from slora.backend.engine.outputs import RequestOutput, failed_output
from slora.backend.runtime.engine_service import EngineService
from slora.backend.runtime.queues import take_batch
from slora.backend.serving.response_stream import Reply, ResponseStream
from slora.backend.serving.triton.errors import FINAL, error_code, send_error
from slora.backend.serving.triton.metrics import NullMetrics

logger = logging.getLogger(__name__)

MAX_BATCH = 4096  # outputs taken from the queue at once
SEND_CHUNK = 16  # responses sent between two looks at the queue


@dataclass
class _InFlight:
    request_id: str
    request: Any  # pb_utils.InferenceRequest, kept alive until the final response
    sender: Any  # its response sender
    stream: ResponseStream
    checked_at: float = field(default_factory=time.monotonic)
    cancelled: bool = False  # by the client
    stopped: bool = False  # by the server, which is stopping (drain.py)


@dataclass(frozen=True)
class _FailAll:
    error: Exception


Queued = tuple[RequestOutput, float] | _FailAll
Pending = dict[str, tuple[_InFlight, list[tuple[RequestOutput, float]]]]  # request id → its outputs not yet sent


class Responder:
    """Start it before the engine (it is the engine's sink), then `serve` once the engine and metrics exist."""

    def __init__(self, check_s: float = 0.2) -> None:
        self._engine: EngineService | None = None
        self._metrics = NullMetrics()
        self._check_s = check_s
        self._lock = threading.Lock()
        self._in_flight: dict[str, _InFlight] = {}
        self._inbox: queue.SimpleQueue[Queued | None] = queue.SimpleQueue()
        self._starting: Pending = {}  # outputs of requests that have sent no token yet (this thread's)
        self._streaming: Pending = {}  # of the others
        self._thread = threading.Thread(target=self._run, name="slora-responder", daemon=True)

    def serve(self, engine: EngineService, metrics: NullMetrics, check_s: float | None = None) -> None:
        """Start answering: cancellations and stops are aborted in `engine`; latencies go to `metrics`; `check_s`
        replaces the cancellation check's period given at construction."""
        self._engine, self._metrics = engine, metrics
        self._check_s = check_s or self._check_s
        self._thread.start()

    def track(self, request_id: str, request: Any, sender: Any, stream: ResponseStream) -> None:
        """Register a request before it is submitted: its outputs are answered from then on."""
        entry = _InFlight(request_id, request, sender, stream)
        with self._lock:
            self._in_flight[request_id] = entry

    def deliver(self, output: RequestOutput) -> None:
        """The engine's sink: queue `output` for this thread (called on the engine's thread, so no work here)."""
        self._inbox.put((output, time.monotonic()))

    def fail_all(self, error: Exception) -> None:
        """The engine is gone: every request in flight ends with `error`, after the outputs queued before."""
        self._inbox.put(_FailAll(error))

    def forget(self, request_id: str) -> None:
        """Drop a request whose submission failed (its error response is sent by the caller)."""
        with self._lock:
            self._in_flight.pop(request_id, None)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def abort_all(self) -> int:
        """Abort every request in flight in the engine (the server is stopping); each then ends with a FINAL
        response whose finish_reason is "abort". Returns how many were in flight; aborting one twice is harmless."""
        with self._lock:
            entries = list(self._in_flight.values())
        for entry in entries:
            entry.stopped = True
            self._abort(entry.request_id)
        return len(entries)

    def stop(self, timeout: float = 10.0) -> None:
        """Send what is queued, then stop (after the engine loop has stopped and aborted what was left)."""
        if self._thread.ident is None:  # never served
            return
        self._inbox.put(None)
        self._thread.join(timeout)

    # ---- the responder thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        swept_at = time.monotonic()
        stopping = False
        while not stopping or self._pending():
            items: list[Queued] = []
            if not stopping:  # wait for work only when none is pending; after the stop marker, flush what is
                items, stopping = take_batch(self._inbox, MAX_BATCH, timeout=0 if self._pending() else self._check_s)
            if items or self._pending():
                began = time.perf_counter()
                self._file(items)
                self._send_some(SEND_CHUNK if not stopping else None)
                self._metrics.responder_busy(time.perf_counter() - began)
            if time.monotonic() - swept_at >= self._check_s:
                self._sweep()
                swept_at = time.monotonic()

    def _pending(self) -> bool:
        return bool(self._starting or self._streaming)

    def _file(self, items: list[Queued]) -> None:
        """Queued outputs into the pending groups, one a request: a request's outputs that queued up go out as one
        response (fewer sends when the responder lags). Outputs of a request no longer in flight (its final
        response sent) are dropped. An engine failure is answered after everything queued before it."""
        for item in items:
            if isinstance(item, _FailAll):
                self._send_some(None)
                self._fail_in_flight(item.error)
                continue
            output, at = item
            entry = self._in_flight.get(output.request_id)
            if entry is not None:
                pending = self._starting if entry.stream.first_token_at is None else self._streaming
                pending.setdefault(output.request_id, (entry, []))[1].append((output, at))

    def _send_some(self, limit: int | None) -> None:
        """Up to `limit` responses (None: all pending): requests that have sent no token yet first, each group in
        the order it came. One engine step brings an output for every running request, and sending them takes a
        while; between two looks at the inbox at most SEND_CHUNK go out, so a new request's first token does not
        wait behind a whole step's responses (the more requests run, as under a flood, the longer that would be)."""
        sent = 0
        while (limit is None or sent < limit) and self._pending():
            pending = self._starting or self._streaming
            entry, outputs = pending.pop(next(iter(pending)))
            self._deliver(entry, outputs)
            sent += 1

    def _fail_in_flight(self, error: Exception) -> None:
        with self._lock:
            entries = list(self._in_flight.values())
        now = time.monotonic()
        for entry in entries:
            self._deliver(entry, [(failed_output(entry.request_id, error), now)])

    def _deliver(self, entry: _InFlight, outputs: list[tuple[RequestOutput, float]]) -> None:
        last, at = outputs[-1]
        try:
            if _ends_in_error(entry, last):
                if len(outputs) > 1:
                    self._reply(entry, outputs[:-1])  # tokens produced before the failure still go out
                self._send_failure(entry, last)
            else:
                self._reply(entry, outputs)
        except Exception:
            logger.exception("sending a response of request %s failed", entry.request_id)
        if last.finished:
            self._metrics.count_finished(last.finish_reason or "error")
            self.forget(entry.request_id)
        elif at - entry.checked_at >= self._check_s:
            self._check(entry)

    def _reply(self, entry: _InFlight, outputs: list[tuple[RequestOutput, float]]) -> None:
        stream = entry.stream
        first = stream.first_token_at is None
        reply = stream.add_many(outputs)
        self._observe(stream)
        if reply is not None:
            self._send(entry, reply)
            if first and stream.stream and stream.first_token_at is not None:  # the first token's way out
                self._metrics.observe("first_response_delay", time.monotonic() - stream.first_token_at)

    def _send_failure(self, entry: _InFlight, output: RequestOutput) -> None:
        code = error_code(output.exception) if output.exception else pb_utils.TritonError.INTERNAL
        if output.finish_reason == "rejected":  # refused before it ran: the message names what is wrong
            send_error(entry.sender, output.error or "request refused", code)
        elif output.finish_reason == "error":
            send_error(entry.sender, f"request failed: {output.error}", code)
        else:
            self._send_abort(entry)

    def _send(self, entry: _InFlight, reply: Reply) -> None:
        tensors = [pb_utils.Tensor(name, array) for name, array in reply.arrays.items()]
        entry.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if reply.final else 0)

    def _send_abort(self, entry: _InFlight) -> None:
        if entry.cancelled:
            send_error(entry.sender, "request cancelled by the client", pb_utils.TritonError.CANCELLED)
        else:
            send_error(entry.sender, "request aborted: the model is shutting down", pb_utils.TritonError.UNAVAILABLE)

    def _observe(self, stream: ResponseStream) -> None:
        for kind, seconds in stream.latencies:
            self._metrics.observe(kind, seconds, stream.tenant)
        stream.latencies.clear()

    def _sweep(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [e for e in self._in_flight.values() if now - e.checked_at >= self._check_s]
        for entry in stale:
            self._check(entry)

    def _check(self, entry: _InFlight) -> None:
        entry.checked_at = time.monotonic()
        if entry.cancelled:
            return
        try:
            cancelled = entry.sender.is_cancelled()
        except Exception:
            logger.exception("checking request %s for cancellation failed", entry.request_id)
            return
        if cancelled:
            logger.info("request %s was cancelled by the client; aborting it", entry.request_id)
            entry.cancelled = True
            self._abort(entry.request_id)

    def _abort(self, request_id: str) -> None:
        if self._engine is not None:
            self._engine.abort(request_id)


def _ends_in_error(entry: _InFlight, last: RequestOutput) -> bool:
    """Failures, refusals and aborts end with an error response, except a request aborted because the server is
    stopping: that one ends with a regular FINAL response (finish_reason "abort"), so that the client keeps what was
    generated and reads why it ended, as from an OpenAI-style server."""
    if last.finish_reason == "abort":
        return not entry.stopped
    return last.finish_reason in ("error", "rejected")
