"""The engine's own process (started by engine_process.py): a `LocalEngine` driven by messages over two pipes.

The messages are the dataclasses of messages.py; outputs go out through an OutputPump (output_pump.py). With
`peer` settings, the engine also takes the requests of peer models on a socket of its own (peers.py). The process
stops when the server asks, or when the requests pipe closes (the server died).
"""

from __future__ import annotations

import logging
import os
import threading
from multiprocessing.connection import Connection

from slora.backend.config import EngineConfig
from slora.backend.runtime.engine_service import LocalEngine
from slora.backend.runtime.fresh_threads import FreshThreadExecutor
from slora.backend.runtime.messages import (
    AbortMsg,
    CommandMsg,
    FailedMsg,
    FatalMsg,
    HeartbeatMsg,
    LogRecord,
    PeerEventsMsg,
    ReadyMsg,
    ResultMsg,
    StopMsg,
    StoppedMsg,
    SubmitMsg,
)
from slora.backend.runtime.output_pump import OutputPump, portable_error
from slora.backend.runtime.peers import EventsListener, PeerSettings, RoutingSink, open_hub
from slora.backend.stub_compat import hide_packages_broken_by_numpy

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
WORKER_DIED_EXIT = 70  # the exit code after a tensor-parallel worker died (FatalMsg says which)


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


def worker_main(
    config: EngineConfig, requests: Connection, outputs: Connection, peer: PeerSettings | None = None
) -> None:
    """The process's entry point: build the engine, report ready (or why not), then serve the requests pipe (and
    with `peer`, the peer models' socket)."""
    pump = OutputPump(outputs)
    _route_logging(pump)
    hide_packages_broken_by_numpy()  # the server's sys.path came along (a NumPy 1 first, on some hosts)
    router = RoutingSink(pump)
    try:
        service = LocalEngine.start(config, router)
        hub = open_hub(peer, service, router, _relay_to(pump)) if peer is not None else None
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
        if hub is not None:
            hub.close()
        admin.shutdown(wait=True)
        pump.post(StoppedMsg())
        pump.close()


def _relay_to(pump: OutputPump) -> EventsListener:
    return lambda events: pump.post(PeerEventsMsg(events))


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
        pump.post(ResultMsg(message.call_id, error=portable_error(exc)))


def _route_logging(pump: OutputPump) -> None:
    root = logging.getLogger("slora")
    root.handlers = [PumpLogHandler(pump)]
    root.setLevel(logging.INFO)
    root.propagate = False
