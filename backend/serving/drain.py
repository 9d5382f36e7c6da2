"""Draining: before slora-serve stops Triton, the `slora` model and its peers end every request in flight.

Why: on SIGTERM, Triton 2.51 first stops every model, then waits for the requests in flight. A request still
generating would get no further response from its stopped model, so Triton would wait out its exit timeout (30 s)
and hang until killed. Ending every request first, with a final response, lets the server stop at once with
nothing lost silently.

The handshake, through files in slora-serve's workspace (the model's `drain_file` parameter). Each peer model
(the `ensemble` alias) joins it while it serves: it writes <drain_file>.<name>.joined, and removes it when it stops.

    slora-serve                                  each model (drain thread, every POLL_S)
    writes <drain_file>              ──►         sees it: refuses new requests (UNAVAILABLE) and aborts every
                                                 request in flight; each ends with a FINAL response whose
                                                 finish_reason is "abort"
    waits for <drain_file>.done and  ◄──         none left in flight: the slora model writes <drain_file>.done,
    <drain_file>.<name>.done for                 a peer <drain_file>.<name>.done (SETTLE_S later: the last
    every peer that joined                       responses are on their way by then)
    sends SIGTERM: nothing is in flight, Triton unloads the models and exits 0
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often the model looks for the drain file, and re-aborts what is still in flight
SETTLE_S = 0.2  # from the last final response to the acknowledgement
DONE_SUFFIX = ".done"


class InFlight(Protocol):
    """The requests a server has in flight (the responder)."""

    def in_flight(self) -> int: ...

    def abort_all(self) -> int: ...


JOINED_SUFFIX = ".joined"


def done_file(drain_file: Path, peer: str | None = None) -> Path:
    """The acknowledgement of the engine model (`peer` None) or of the peer model `peer`."""
    stem = drain_file.name if peer is None else f"{drain_file.name}.{peer}"
    return drain_file.with_name(stem + DONE_SUFFIX)


def joined_file(drain_file: Path, peer: str) -> Path:
    return drain_file.with_name(f"{drain_file.name}.{peer}{JOINED_SUFFIX}")


def join(drain_file: Path, peer: str) -> None:
    """`peer` takes part in the drain: slora-serve waits for its acknowledgement too."""
    done_file(drain_file, peer).unlink(missing_ok=True)
    joined_file(drain_file, peer).touch()


def leave(drain_file: Path, peer: str) -> None:
    joined_file(drain_file, peer).unlink(missing_ok=True)


def peers(drain_file: Path) -> list[str]:
    """The peer models that take part in the drain now."""
    prefix, suffix = drain_file.name + ".", JOINED_SUFFIX
    return [p.name[len(prefix) : -len(suffix)] for p in drain_file.parent.glob(f"{drain_file.name}.*{suffix}")]


def all_done(drain_file: Path) -> bool:
    """Whether the engine model and every peer that joined have acknowledged (a peer that left needs not)."""
    return done_file(drain_file).exists() and all(done_file(drain_file, peer).exists() for peer in peers(drain_file))


def clear(drain_file: Path) -> None:
    """Remove the files of an earlier run (a reused workspace), so that a new server does not drain at once."""
    for peer in peers(drain_file):
        leave(drain_file, peer)
        done_file(drain_file, peer).unlink(missing_ok=True)
    drain_file.unlink(missing_ok=True)
    done_file(drain_file).unlink(missing_ok=True)


class DrainWatcher:
    """A thread that waits for the drain file, then ends every request in flight and acknowledges."""

    def __init__(self, drain_file: Path, requests: InFlight, poll_s: float = POLL_S, peer: str | None = None) -> None:
        """`peer`: the name of a peer model, which acknowledges in a file of its own (join it first)."""
        self.drain_file = drain_file
        self._peer = peer
        self._requests = requests
        self._poll_s = poll_s
        self._draining = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slora-drain", daemon=True)
        self._thread.start()

    @property
    def draining(self) -> bool:
        """True once asked to drain: new requests are to be refused."""
        return self._draining.is_set()

    def close(self, timeout: float = 5.0) -> None:
        self._closed.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self.drain_file.exists():
            if self._closed.wait(self._poll_s):
                return
        self._draining.set()
        logger.info("the server is stopping: ending %d requests in flight", self._requests.in_flight())
        while self._requests.in_flight() and not self._closed.is_set():
            # Again each round: a request that was being submitted when the drain began is aborted here.
            self._requests.abort_all()
            self._closed.wait(self._poll_s)
        self._closed.wait(SETTLE_S)
        done_file(self.drain_file, self._peer).touch()
        logger.info("no request in flight: ready to stop")
