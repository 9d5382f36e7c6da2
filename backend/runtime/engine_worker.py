"""The engine's own process (started by engine_process.py): a `LocalEngine` driven by messages over two pipes.

    server ── requests ──► ("submit", Submission)  ("abort", request_id)  ("command", call_id, AdapterCommand)
                           ("stop",)
    server ◄── outputs ─── ("log", [(level, logger, message)])  ("ready", EngineInfo, EngineStats)
                           ("failed", message)  ("outputs", [RequestOutput], EngineStats | None)
                           ("result", call_id, ok, value)  ("stopped",)

A pump thread sends what queued up while it was busy as one message, so a step's outputs cost the server one
receive. The process stops when the server asks, or when the requests pipe closes (the server died).
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import queue
import threading
from multiprocessing.connection import Connection
from typing import Any

from slora.backend.config import EngineConfig
from slora.backend.engine.outputs import EngineStats, RequestOutput
from slora.backend.runtime.engine_service import LocalEngine
from slora.backend.runtime.fresh_threads import FreshThreadExecutor
from slora.backend.serving.request_inputs import AdapterCommand
from slora.backend.stub_compat import hide_packages_broken_by_numpy

logger = logging.getLogger(__name__)

_OUTPUT, _STATS, _LOG, _MESSAGE = range(4)
MAX_BATCH = 4096  # queued items taken at once


class OutputPump:
    """Batches outputs, statistics and log records into messages on the outputs pipe, in order."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="slora-pump", daemon=True)
        self._thread.start()

    def output(self, output: RequestOutput) -> None:
        self._queue.put((_OUTPUT, output))

    def stats(self, stats: EngineStats) -> None:
        self._queue.put((_STATS, stats))

    def log(self, level: int, name: str, message: str) -> None:
        self._queue.put((_LOG, (level, name, message)))

    def post(self, message: tuple[Any, ...]) -> None:
        """Send `message` after everything queued before it."""
        self._queue.put((_MESSAGE, message))

    def close(self, timeout: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            while len(items) < MAX_BATCH:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if not self._forward(items):
                return

    def _forward(self, items: list[tuple[int, Any] | None]) -> bool:
        outputs: list[RequestOutput] = []
        logs: list[tuple[int, str, str]] = []
        stats: EngineStats | None = None
        for item in items:
            if item is not None and item[0] == _OUTPUT:
                outputs.append(_portable(item[1]))
            elif item is not None and item[0] == _STATS:
                stats = item[1]
            elif item is not None and item[0] == _LOG:
                logs.append(item[1])
            else:
                self._flush(outputs, stats, logs)
                outputs, logs, stats = [], [], None
                if item is None:
                    return False
                self._send(item[1])
        self._flush(outputs, stats, logs)
        return True

    def _flush(self, outputs: list[RequestOutput], stats: EngineStats | None, logs: list[tuple[int, str, str]]) -> None:
        if logs:
            self._send(("log", logs))
        if outputs or stats is not None:
            self._send(("outputs", outputs, stats))

    def _send(self, message: tuple[Any, ...]) -> None:
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
            self._pump.log(record.levelno, record.name, self.format(record))
        except Exception:
            self.handleError(record)


def worker_main(config: EngineConfig, requests: Connection, outputs: Connection) -> None:
    """The process's entry point: build the engine, report ready (or why not), then serve the requests pipe."""
    pump = OutputPump(outputs)
    _route_logging(pump)
    hide_packages_broken_by_numpy()  # the server's sys.path came along (a NumPy 1 first, on some hosts)
    try:
        service = LocalEngine.start(config)
    except Exception as exc:
        logger.debug("engine construction failed", exc_info=exc)
        pump.post(("failed", f"{type(exc).__name__}: {exc}"))
        pump.close()
        return
    service.on_stats(pump.stats)
    pump.post(("ready", service.info, service.stats()))
    admin = FreshThreadExecutor(max_workers=1, thread_name_prefix="slora-admin")  # adapter reads: fresh_threads.py
    try:
        _serve(requests, service, pump, admin)
    finally:
        service.stop()  # aborts what is left: those outputs go out before "stopped"
        admin.shutdown(wait=True)
        pump.post(("stopped",))
        pump.close()


def _serve(requests: Connection, service: LocalEngine, pump: OutputPump, admin: FreshThreadExecutor) -> None:
    while True:
        try:
            message = requests.recv()
        except (EOFError, OSError):
            logger.warning("the server closed the engine's pipe; stopping the engine")
            return
        kind = message[0]
        if kind == "submit":
            service.submit(message[1], pump.output)
        elif kind == "abort":
            service.abort(message[1])
        elif kind == "command":
            admin.submit(_command, service, pump, message[1], message[2])
        elif kind == "stop":
            return
        else:
            logger.error("unknown message %r from the server; ignored", kind)


def _command(service: LocalEngine, pump: OutputPump, call_id: int, command: AdapterCommand) -> None:
    try:
        pump.post(("result", call_id, True, service.command(command)))
    except Exception as exc:  # handed to the caller, who asked for it
        pump.post(("result", call_id, False, _portable_error(exc)))


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
