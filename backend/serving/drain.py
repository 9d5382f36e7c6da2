"""Draining: before slora-serve stops Triton, the `slora` model ends every request in flight.

Why: on SIGTERM, Triton 2.51 first stops every model, then waits for the requests in flight. A request still
generating would get no further response from its stopped model, and a streamed `ensemble` request never completes
(nor does a request whose client went away: the ensemble does not pass the cancellation on to `slora`). Triton
then waits out its exit timeout (30 s) and hangs until killed. Ending every request first, with a final response,
lets the server stop at once with nothing lost silently.

The handshake, through two files in slora-serve's workspace (the model's `drain_file` parameter):

    slora-serve                                  slora model (drain thread, every POLL_S)
    writes <drain_file>              ──►         sees it: refuses new requests (UNAVAILABLE) and aborts every
                                                 request in flight; each ends with a FINAL response whose
                                                 finish_reason is "abort", which ends its ensemble request too
    waits for <drain_file>.done      ◄──         none left in flight: writes <drain_file>.done (SETTLE_S later:
                                                 the ensembles' last responses are on their way by then)
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


def done_file(drain_file: Path) -> Path:
    return drain_file.with_name(drain_file.name + DONE_SUFFIX)


def clear(drain_file: Path) -> None:
    """Remove the files of an earlier run (a reused workspace), so that a new server does not drain at once."""
    drain_file.unlink(missing_ok=True)
    done_file(drain_file).unlink(missing_ok=True)


class DrainWatcher:
    """A thread that waits for the drain file, then ends every request in flight and acknowledges."""

    def __init__(self, drain_file: Path, requests: InFlight, poll_s: float = POLL_S) -> None:
        self.drain_file = drain_file
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
        done_file(self.drain_file).touch()
        logger.info("no request in flight: ready to stop")
