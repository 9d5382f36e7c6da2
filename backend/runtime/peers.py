"""Peer models: other Triton models of the same repository served by the `slora` model's engine, not a second one.

The `ensemble` name is such a peer (serving/triton/alias_model.py). Routing it through a Triton ensemble platform
model cost every streamed response a pass through Triton's ensemble scheduler, on the thread that sends the
`slora` model's responses; as a peer, its own Python stub tokenizes its requests and sends their responses, and
only the engine is shared:

    alias stub (EnginePeer) ── unix socket ──► PeerHub (in the engine's process) ──► engine.submit / abort
                            ◄── OutputsMsg ──── RoutingSink: the outputs of a peer's requests go to its socket,
                                                every other output to the engine's own sink, as before

The socket is `peer_address(repository, model)`: a file in a folder of the temporary directory that only this
user may enter (the messages are pickles; whoever may connect could run code as the engine), named after the model
repository, the engine model and the Triton server process (both stubs' parent), so that both sides find it from
what Triton tells each model. A peer that disconnects has its requests aborted (their pages freed); when the engine
stops, each peer's socket closes after its last outputs, and the peer fails what it still waits for and connects
again to the next engine. The peers' request metrics (first-token and inter-token latencies, finish reasons) come
to the hub and go on to the engine model (`on_events`), whose slora_* series count every model's requests.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import socket
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

from slora.backend.engine.outputs import RequestOutput
from slora.backend.runtime.messages import (
    AbortMsg,
    EngineInfo,
    PeerEventsMsg,
    PeerHelloMsg,
    PeerWelcomeMsg,
    Submission,
    SubmitMsg,
)
from slora.backend.runtime.output_pump import OutputPump
from slora.backend.runtime.output_sink import OutputSink

logger = logging.getLogger(__name__)

ACCEPT_POLL_S = 0.5  # how often the accepting thread looks whether the hub is closing
HELLO_TIMEOUT_S = 10.0  # a connection that says nothing for this long is not a peer
EventsListener = Callable[[list[tuple[str, Any]]], None]


@dataclass(frozen=True)
class PeerSettings:
    """What an engine needs to take peers: where to listen, and the options its peers take requests with."""

    address: str
    serving: Any  # the engine model's ServingOptions


def peer_address(repository: str | Path, model: str, server_pid: int | None = None) -> str:
    """The socket of `model`'s engine in the model repository `repository` of the Triton server `server_pid`
    (default: this process's parent, which is the server for a Python-backend stub); both sides derive it alike,
    and two servers of one repository on one host (one per GPU, say) never share one."""
    server = os.getppid() if server_pid is None else server_pid
    key = hashlib.sha256(f"{Path(repository).resolve()}\0{model}\0{server}".encode()).hexdigest()[:20]
    return str(_private_dir() / f"{key}.sock")


def note_load_failure(address: str, reason: str) -> None:
    """Leave beside the engine's socket why its model failed to load: its peers then fail at once, saying so,
    instead of waiting for an engine that will not come (Triton finishes starting only when every model has)."""
    note = _failure_note(address)
    partial = note.with_name(note.name + ".partial")
    partial.write_text(reason)
    partial.replace(note)


def clear_load_failure(address: str) -> None:
    """A new load of the engine's model begins: an earlier failure no longer holds."""
    _failure_note(address).unlink(missing_ok=True)


def load_failure(address: str) -> str | None:
    """Why the model of the engine at `address` failed to load, or None while it has not (or loads again)."""
    try:
        return _failure_note(address).read_text()
    except OSError:
        return None


def _failure_note(address: str) -> Path:
    return Path(address + ".failed")


def _private_dir() -> Path:
    folder = Path(tempfile.gettempdir()) / f"slora-peers-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    if folder.stat().st_uid != os.getuid() or folder.stat().st_mode & 0o077:
        raise PermissionError(f"{folder} must belong to this user and be closed to others (mode 700)")
    return folder


class Intake(Protocol):
    """The engine, as a peer's requests reach it (LocalEngine)."""

    info: EngineInfo

    def submit(self, job: Submission) -> None: ...

    def abort(self, request_id: str) -> None: ...


class RoutingSink:
    """The engine's sink when it takes peers: a peer's request's outputs go to that peer, the rest to `default`."""

    def __init__(self, default: OutputSink) -> None:
        self._default = default
        self._lock = threading.Lock()
        self._routes: dict[str, OutputSink] = {}

    def route(self, request_id: str, sink: OutputSink) -> None:
        """Send `request_id`'s outputs to `sink` (before it is submitted), until its final one."""
        with self._lock:
            self._routes[request_id] = sink

    def routed_to(self, sink: OutputSink) -> list[str]:
        with self._lock:
            return [request_id for request_id, target in self._routes.items() if target is sink]

    def deliver(self, output: RequestOutput) -> None:
        with self._lock:
            sink = (self._routes.pop if output.finished else self._routes.get)(output.request_id, None)
        (sink or self._default).deliver(output)

    def fail_all(self, error: Exception) -> None:
        """The default sink's requests fail (an engine on a thread of the stub died); peers see their socket close."""
        fail_all = getattr(self._default, "fail_all", None)
        if fail_all is not None:
            fail_all(error)


class _PeerPump(OutputPump):
    """One peer's outputs, sent on its socket (a pump thread: the engine's thread only queues)."""

    def __init__(self, conn: Connection, name: str) -> None:
        super().__init__(conn)
        self.name = name


class PeerHub:
    """Accepts peers on `settings.address` and hands their requests to `engine`; their outputs come back through
    `router`, the engine's sink."""

    def __init__(self, settings: PeerSettings, engine: Intake, router: RoutingSink) -> None:
        self._settings = settings
        self._engine = engine
        self._router = router
        self.on_events: EventsListener = _ignore  # where the peers' request metrics go (the engine model's)
        self._closing = threading.Event()
        self._peers: dict[int, tuple[Connection, _PeerPump]] = {}
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        self._socket = _listen(settings.address)
        self._thread = threading.Thread(target=self._accept, name="slora-peers", daemon=True)
        self._thread.start()
        logger.info("taking peer models' requests on %s", settings.address)

    def close(self) -> None:
        """Stop accepting; each peer's socket closes after the outputs queued for it (call after the engine stopped,
        so that its aborts reach the peers)."""
        self._closing.set()
        self._thread.join(2 * ACCEPT_POLL_S)
        self._socket.close()
        Path(self._settings.address).unlink(missing_ok=True)
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for conn, pump in peers:
            pump.close()  # sends what is queued
            shut_down(conn)  # its reading thread sees the socket end, and closes it

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._socket.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), name="slora-peer", daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        client.setblocking(True)  # a Connection reads its file descriptor directly
        conn = Connection(client.detach())
        number = next(self._numbers)
        try:
            hello = conn.recv() if conn.poll(HELLO_TIMEOUT_S) else None
        except Exception:  # closed, or not one of our messages
            hello = None
        if not isinstance(hello, PeerHelloMsg):
            logger.warning("a connection to the peer socket did not introduce itself as a peer model; closed")
            conn.close()
            return
        pump = _PeerPump(conn, hello.name)
        with self._lock:
            self._peers[number] = (conn, pump)
        conn.send(PeerWelcomeMsg(self._engine.info, self._settings.serving))
        logger.info("peer model %r connected", hello.name)
        self._read(conn, pump)
        self._disconnected(number, conn, pump)

    def _read(self, conn: Connection, pump: _PeerPump) -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            except Exception as exc:  # not one of our messages: the peer is broken, as if it had gone
                logger.error("peer model %r sent what is not a message (%s); disconnecting it", pump.name, exc)
                return
            if isinstance(message, SubmitMsg):
                self._router.route(message.job.request_id, pump)
                self._engine.submit(message.job)
            elif isinstance(message, AbortMsg):
                self._engine.abort(message.request_id)
            elif isinstance(message, PeerEventsMsg):
                self.on_events(message.events)
            else:
                logger.error("unknown message %r from peer model %r; ignored", type(message).__name__, pump.name)

    def _disconnected(self, number: int, conn: Connection, pump: _PeerPump) -> None:
        """The peer went away (its model unloaded, or the engine is closing): its requests are aborted."""
        with self._lock:
            self._peers.pop(number, None)
        orphans = self._router.routed_to(pump)
        for request_id in orphans:
            self._engine.abort(request_id)
        pump.close()
        conn.close()
        if not self._closing.is_set():
            logger.info("peer model %r disconnected; %d of its requests aborted", pump.name, len(orphans))


def shut_down(conn: Connection) -> None:
    """End `conn`'s socket for both sides, so that the thread reading it sees it end and closes it (closing it here
    would pull the file from under that thread's read)."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as duplicate:
            duplicate.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed already
        pass


def _ignore(events: list[tuple[str, Any]]) -> None:
    pass


def open_hub(
    settings: PeerSettings, engine: Intake, router: RoutingSink, on_events: EventsListener | None = None
) -> PeerHub | None:
    """The peers' socket; without it the engine still serves its own model (the peers then fail to load, saying
    which engine they waited for)."""
    try:
        hub = PeerHub(settings, engine, router)
        if on_events is not None:
            hub.on_events = on_events
        return hub
    except OSError as exc:
        logger.error("peer models cannot reach this engine: listening on %s failed: %s", settings.address, exc)
        return None


def _listen(address: str) -> socket.socket:
    """A listening unix socket at `address`, replacing the file an engine process that died left there."""
    Path(address).unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(address)
    os.chmod(address, 0o600)
    server.listen(16)
    server.settimeout(ACCEPT_POLL_S)
    return server
