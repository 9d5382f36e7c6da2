"""`EnginePeer`: another model's engine, reached on its peer socket (peers.py), behind the EngineService interface.

A connector thread connects to the socket, introduces itself, takes the welcome (the engine's info and the
serving options of its model) and then receives the outputs of this peer's requests, handing each to the sink.
When the socket closes (the engine process exited, or its model was unloaded), every request in flight fails with
a message saying so, new ones are refused (UNAVAILABLE) and the thread connects again, to the next engine process.
Request metrics reported here (`report`) go to the engine every EVENTS_S, for its model's slora_* series.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from slora.backend.engine.outputs import EngineStats, failed_output
from slora.backend.errors import EngineOverloadedError
from slora.backend.runtime.engine_service import EngineHealth, StatsListener
from slora.backend.runtime.messages import (
    AbortMsg,
    AdapterCommand,
    EngineInfo,
    OutputsMsg,
    PeerEventsMsg,
    PeerHelloMsg,
    PeerWelcomeMsg,
    Submission,
    SubmitMsg,
    ToEngine,
)
from slora.backend.runtime.output_sink import RequestSink, deliver_each
from slora.backend.runtime.peers import load_failure, shut_down

logger = logging.getLogger(__name__)

RETRY_S = 0.2  # between attempts to connect
WELCOME_TIMEOUT_S = 30.0
EVENTS_S = 0.1  # how often the request metrics go to the engine
MAX_EVENTS = 100_000  # kept while no engine is connected; older ones are dropped
WelcomeHook = Callable[[PeerWelcomeMsg], None]


class EnginePeer:
    def __init__(self, address: str, name: str, engine_model: str, sink: RequestSink, on_welcome: WelcomeHook) -> None:
        """Outputs go to `sink`; `on_welcome` is called with each engine's welcome before its requests are sent
        (on the connector thread: the first one prepares the model, e.g. loads the tokenizer)."""
        self._address = address
        self._name = name
        self._engine_model = engine_model
        self._sink = sink
        self._on_welcome = on_welcome
        self._send_lock = threading.Lock()
        self._conn: Connection | None = None
        self._welcome: PeerWelcomeMsg | None = None
        self._closed_reason = f"the engine of model {engine_model!r} is not serving yet"
        self._connected = threading.Event()
        self._settled = threading.Event()  # connected, or failed for good
        self.failure: str | None = None  # why this peer cannot serve (its welcome hook failed)
        self._stopping = threading.Event()
        self._events: list[tuple[str, Any]] = []
        self._events_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="slora-peer-connector", daemon=True)
        self._thread.start()
        self._events_thread = threading.Thread(target=self._send_events, name="slora-peer-metrics", daemon=True)
        self._events_thread.start()

    @property
    def info(self) -> EngineInfo:
        if self._welcome is None:
            raise RuntimeError(self._closed_reason)
        return self._welcome.info

    def wait_connected(self, timeout: float) -> bool:
        """Whether it connected within `timeout`; False also at once when it failed for good (see `failure`)."""
        self._settled.wait(timeout)
        return self._connected.is_set()

    def submit(self, job: Submission) -> None:
        """Send `job` to the engine; refused at once while none is connected."""
        if self._conn is None or not self._send(SubmitMsg(job)):
            deliver_each(self._sink, [failed_output(job.request_id, EngineOverloadedError(self._closed_reason),
                                                    "rejected")])  # fmt: skip

    def abort(self, request_id: str) -> None:
        self._send(AbortMsg(request_id))

    def report(self, kind: str, value: Any) -> None:
        """A request metric, for the engine model's series: ("ttft" | "itl", seconds) or ("finished", reason)."""
        with self._events_lock:
            self._events.append((kind, value))
            if len(self._events) > MAX_EVENTS:
                del self._events[: len(self._events) - MAX_EVENTS]

    def command(self, command: AdapterCommand) -> dict[str, Any]:
        raise ValueError(f"adapter commands go to the {self._engine_model!r} model, not to {self._name!r}")

    def stats(self) -> EngineStats:
        raise NotImplementedError(f"the engine's statistics are the {self._engine_model!r} model's to report")

    def on_stats(self, listener: StatsListener) -> None:
        """Statistics stay with the engine's own model (its metrics count every model's requests)."""

    def health(self) -> EngineHealth:
        if self._stopping.is_set():
            return EngineHealth("stopped", "the model has stopped")
        if self._conn is None:
            return EngineHealth("restarting", self._closed_reason)
        return EngineHealth("serving")

    def stop(self) -> None:
        self._stopping.set()
        conn = self._conn
        if conn is not None:
            shut_down(conn)  # the connector thread sees the socket end, and closes it
        self._thread.join(5.0)
        self._events_thread.join(2 * EVENTS_S)

    # ---- the connector thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            conn = self._connect()
            if conn is None:
                if not self._settled.is_set() and self._engine_failed():
                    return
                self._stopping.wait(RETRY_S)
                continue
            self._receive(conn)
            self._disconnected()

    def _connect(self) -> Connection | None:
        """A welcomed connection to the engine, or None (no engine listening yet: try again later)."""
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            client.connect(self._address)
        except OSError:
            client.close()
            return None
        conn = Connection(client.detach())
        welcome = self._welcomed(conn)
        if welcome is None:
            conn.close()
            return None
        try:
            self._on_welcome(welcome)
        except Exception as exc:  # this model cannot take requests (say, its tokenizer does not load): for good
            self.failure = f"{type(exc).__name__}: {exc}"
            logger.error("%s cannot serve through the engine of model %r: %s", self._name, self._engine_model,
                         self.failure)  # fmt: skip
            conn.close()
            self._stopping.set()
            self._settled.set()
            return None
        self._welcome = welcome
        with self._send_lock:
            self._conn = conn
        self._connected.set()
        self._settled.set()
        logger.info("%s serves through the engine of model %r", self._name, self._engine_model)
        return conn

    def _engine_failed(self) -> bool:
        """Whether the engine's model failed to load (its note, peers.note_load_failure): this peer fails for good."""
        reason = load_failure(self._address)
        if reason is None:
            return False
        self.failure = f"model {self._engine_model!r} failed to load: {reason}"
        logger.error("%s cannot serve: %s", self._name, self.failure)
        self._stopping.set()
        self._settled.set()
        return True

    def _welcomed(self, conn: Connection) -> PeerWelcomeMsg | None:
        """The engine's welcome after this peer's hello, or None (logged; the connector tries again)."""
        try:
            conn.send(PeerHelloMsg(self._name))
            welcome = conn.recv() if conn.poll(WELCOME_TIMEOUT_S) else None
            problem = f"got {type(welcome).__name__}"
        except Exception as exc:
            welcome, problem = None, str(exc)
        if isinstance(welcome, PeerWelcomeMsg):
            return welcome
        logger.error("no welcome from the engine of model %r (%s); trying again", self._engine_model, problem)
        self._stopping.wait(1.0)
        return None

    def _receive(self, conn: Connection) -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            except Exception:  # not one of our messages: treated as the engine gone
                logger.exception("the engine of model %r sent what is not a message", self._engine_model)
                return
            if isinstance(message, OutputsMsg):
                deliver_each(self._sink, message.outputs)

    def _disconnected(self) -> None:
        with self._send_lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
        if self._stopping.is_set():
            reason = f"the {self._name!r} model has stopped"
        else:
            reason = f"the engine of model {self._engine_model!r} stopped; connecting to its next one"
            logger.warning("%s: failing the requests in flight", reason)
        self._closed_reason = reason
        self._sink.fail_all(RuntimeError(reason))

    def _send_events(self) -> None:
        while not self._stopping.wait(EVENTS_S):
            if self._conn is None or not self._events:
                continue
            with self._events_lock:
                events, self._events = self._events, []
            if not self._send(PeerEventsMsg(events)):
                with self._events_lock:
                    self._events[:0] = events

    def _send(self, message: ToEngine | PeerEventsMsg) -> bool:
        with self._send_lock:
            if self._conn is None:
                return False
            try:
                self._conn.send(message)
                return True
            except (OSError, ValueError):  # the engine is gone: the connector thread fails what is in flight
                return False
