"""`OutputPump`: an engine process's outputs, statistics and log records, sent on a connection in batches.

A pump thread sends what queued up while it was busy as one message, so a step's outputs cost the receiving side
one receive; the engine's thread only queues. One pump per connection: the server's outputs pipe, and each peer
model's socket (peers.py).
"""

from __future__ import annotations

import dataclasses
import pickle
import queue
import threading
from multiprocessing.connection import Connection
from typing import TypeAlias

from slora.backend.engine.outputs import EngineStats, RequestOutput
from slora.backend.runtime.messages import FromEngine, LogMsg, LogRecord, OutputsMsg
from slora.backend.runtime.queues import take_batch

MAX_BATCH = 4096  # queued items taken at once
PumpItem: TypeAlias = RequestOutput | EngineStats | LogRecord | FromEngine


class OutputPump:
    """The engine's sink in its own process: batches outputs, statistics and log records into messages on the
    outputs pipe, in order (it routes nothing: the server's side knows whose each output is)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[PumpItem | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="slora-pump", daemon=True)
        self._thread.start()

    def deliver(self, output: RequestOutput) -> None:
        self._queue.put(output)

    def stats(self, stats: EngineStats) -> None:
        self._queue.put(stats)

    def log(self, record: LogRecord) -> None:
        self._queue.put(record)

    def post(self, message: FromEngine) -> None:
        """Send `message` after everything queued before it."""
        self._queue.put(message)

    def close(self, timeout: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        stopping = False
        while not stopping:
            items, stopping = take_batch(self._queue, MAX_BATCH)
            self._forward(items)

    def _forward(self, items: list[PumpItem]) -> None:
        outputs: list[RequestOutput] = []
        logs: list[LogRecord] = []
        stats: EngineStats | None = None
        for item in items:
            if isinstance(item, RequestOutput):
                outputs.append(portable(item))
            elif isinstance(item, EngineStats):
                stats = item
            elif isinstance(item, LogRecord):
                logs.append(item)
            else:
                self._flush(outputs, stats, logs)
                outputs, logs, stats = [], [], None
                self._send(item)
        self._flush(outputs, stats, logs)

    def _flush(self, outputs: list[RequestOutput], stats: EngineStats | None, logs: list[LogRecord]) -> None:
        if logs:
            self._send(LogMsg(logs))
        if outputs or stats is not None:
            self._send(OutputsMsg(outputs, stats))

    def _send(self, message: FromEngine) -> None:
        try:
            self._conn.send(message)
        except (OSError, ValueError):  # the server is gone; the requests pipe tells the main thread
            pass


def portable(output: RequestOutput) -> RequestOutput:
    """`output`, with its exception replaced by a RuntimeError of the same message if it cannot be pickled."""
    if output.exception is None:
        return output
    return dataclasses.replace(output, exception=portable_error(output.exception))


def portable_error(exc: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
