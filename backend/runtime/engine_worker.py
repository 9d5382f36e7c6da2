"""The engine's own process (started by engine_process.py): a `LocalEngine` driven by messages over two pipes.

The messages are the dataclasses of messages.py. A pump thread sends what queued up while it was busy as one
message, so a step's outputs cost the server one receive. The process stops when the server asks, or when the
requests pipe closes (the server died).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import queue
import threading
from multiprocessing.connection import Connection
from typing import TypeAlias

from slora.backend.config import EngineConfig
from slora.backend.engine.outputs import EngineStats, RequestOutput
from slora.backend.runtime.engine_service import LocalEngine
from slora.backend.runtime.fresh_threads import FreshThreadExecutor
from slora.backend.runtime.messages import (
    AbortMsg,
    CommandMsg,
    FailedMsg,
    FatalMsg,
    FromEngine,
    HeartbeatMsg,
    LogMsg,
    LogRecord,
    OutputsMsg,
    ReadyMsg,
    ResultMsg,
    StopMsg,
    StoppedMsg,
    SubmitMsg,
)
from slora.backend.runtime.queues import take_batch
from slora.backend.stub_compat import hide_packages_broken_by_numpy

logger = logging.getLogger(__name__)

MAX_BATCH = 4096  # queued items taken at once
HEARTBEAT_S = 0.5
WORKER_DIED_EXIT = 70  # the exit code after a tensor-parallel worker died (FatalMsg says which)
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
                outputs.append(_portable(item))
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


class PumpLogHandler(logging.Handler):
    """Hands this process's `slora` log records to the server, which writes them into Triton's log."""

    def __init__(self, pump: OutputPump) -> None:
        super().__init__()
        self._pump = pump

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._pump.log(LogRecord(record.levelno, record.name, self.format(record)))
        except Exception:
            self.handleError(record)


def worker_main(config: EngineConfig, requests: Connection, outputs: Connection) -> None:
    """The process's entry point: build the engine, report ready (or why not), then serve the requests pipe."""
    pump = OutputPump(outputs)
    _route_logging(pump)
    hide_packages_broken_by_numpy()  # the server's sys.path came along (a NumPy 1 first, on some hosts)
    try:
        service = LocalEngine.start(config, pump)
    except Exception as exc:
        logger.debug("engine construction failed", exc_info=exc)
        pump.post(FailedMsg(f"{type(exc).__name__}: {exc}"))
        pump.close()
        return
    service.on_stats(pump.stats)
    _exit_when_workers_fail(service, pump)
    pump.post(ReadyMsg(service.info, service.stats()))
    beating = threading.Event()
    threading.Thread(target=_heartbeat, args=(service, pump, beating), name="slora-heartbeat", daemon=True).start()
    admin = FreshThreadExecutor(max_workers=1, thread_name_prefix="slora-admin")  # adapter reads: fresh_threads.py
    try:
        _serve(requests, service, pump, admin)
    finally:
        beating.set()
        service.stop()  # aborts what is left: those outputs go out before "stopped"
        admin.shutdown(wait=True)
        pump.post(StoppedMsg())
        pump.close()


def _exit_when_workers_fail(service: LocalEngine, pump: OutputPump) -> None:
    """With tensor parallelism, a worker that dies ends this process, its reason sent first: the server fails the
    requests in flight with it and starts a new engine process, as for this process dying."""
    workers = service.loop.engine.parallel
    if workers is None:
        return

    def fail(reason: str) -> None:
        pump.post(FatalMsg(reason))
        pump.close()
        os._exit(WORKER_DIED_EXIT)

    workers.on_failure = fail
    if workers.failure is not None:  # it died before the hook was set
        fail(workers.failure)


def _heartbeat(service: LocalEngine, pump: OutputPump, stop: threading.Event) -> None:
    """Tell the server, every HEARTBEAT_S, how long ago the engine loop last went round (its watchdog's input)."""
    while not stop.wait(HEARTBEAT_S):
        pump.post(HeartbeatMsg(service.loop.beat_age()))


def _serve(requests: Connection, service: LocalEngine, pump: OutputPump, admin: FreshThreadExecutor) -> None:
    while True:
        try:
            message = requests.recv()
        except (EOFError, OSError):
            logger.warning("the server closed the engine's pipe; stopping the engine")
            return
        if isinstance(message, SubmitMsg):
            service.submit(message.job)
        elif isinstance(message, AbortMsg):
            service.abort(message.request_id)
        elif isinstance(message, CommandMsg):
            admin.submit(_command, service, pump, message)
        elif isinstance(message, StopMsg):
            return
        else:
            logger.error("unknown message %r from the server; ignored", type(message).__name__)


def _command(service: LocalEngine, pump: OutputPump, message: CommandMsg) -> None:
    try:
        pump.post(ResultMsg(message.call_id, value=service.command(message.command)))
    except Exception as exc:  # handed to the caller, who asked for it
        pump.post(ResultMsg(message.call_id, error=_portable_error(exc)))


def _route_logging(pump: OutputPump) -> None:
    root = logging.getLogger("slora")
    root.handlers = [PumpLogHandler(pump)]
    root.setLevel(logging.INFO)
    root.propagate = False


def _portable(output: RequestOutput) -> RequestOutput:
    """`output`, with its exception replaced by a RuntimeError of the same message if it cannot be pickled."""
    if output.exception is None:
        return output
    return dataclasses.replace(output, exception=_portable_error(output.exception))


def _portable_error(exc: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
