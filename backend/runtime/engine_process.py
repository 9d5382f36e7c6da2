"""`EngineProcess`: the engine in a process of its own, behind the same interface as `LocalEngine`.

In Triton's Python stub, the engine loop (scheduling, batch building, sampling: Python between GPU launches) and
the responder (one Triton response per request per step) would share one GIL, and each would wait for the
other. Here the engine runs in a child process (engine_worker.py) started with `spawn` from this interpreter's
sys.path; requests go down one pipe, each step's outputs come back as one message on the other, read by a
receiver thread that hands them to the sink. This side keeps no table of requests: the sink (the responder, in
Triton) knows which it waits on, and `fail_all` ends them when the process dies.

If the child dies, every request in flight ends with an error naming the exit code, and later requests are
refused (UNAVAILABLE) with that message: nothing waits forever. A new child is started (up to `max_restarts` in
the life of the server); before it serves, it is given back every adapter registration made at runtime that
succeeded (`load` with a path, `unload`: adapter_admin.RuntimeRegistry), so that requests that worked before the
crash work after it, with the same weights. With `write_back_registry`, those registrations are also written to
the config's `adapter_registry` (the multi_lora.json of `--lora-registry`) as they succeed, so that a server
started again from it serves them too.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import shutil
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

from slora.backend.config import EngineConfig
from slora.backend.engine.outputs import STATS_COUNTERS, EngineStats, RequestOutput, failed_output
from slora.backend.errors import AdapterError, AdapterNotFoundError, EngineOverloadedError
from slora.backend.runtime.adapter_admin import RuntimeRegistry
from slora.backend.runtime.engine_service import EngineHealth, StatsListener
from slora.backend.runtime.engine_worker import worker_main
from slora.backend.runtime.messages import (
    AbortMsg,
    AdapterCommand,
    CommandMsg,
    EngineInfo,
    FailedMsg,
    FatalMsg,
    HeartbeatMsg,
    LogMsg,
    LogRecord,
    OutputsMsg,
    PeerEventsMsg,
    ReadyMsg,
    ResultMsg,
    StopMsg,
    StoppedMsg,
    Submission,
    SubmitMsg,
    ToEngine,
)
from slora.backend.runtime.output_sink import RequestSink, deliver_each
from slora.backend.runtime.peers import EventsListener, PeerSettings

logger = logging.getLogger(__name__)

PYTHON_ENV = "SLORA_PYTHON"  # the interpreter for the engine process (slora-serve sets it)
MAX_RESTARTS = 3  # engine processes started again after one exits unexpectedly, in the life of the server


def interpreter() -> str:
    """The Python to start the engine process with: $SLORA_PYTHON, else this one (unless it is Triton's stub)."""
    configured = os.environ.get(PYTHON_ENV)
    if configured:
        return configured
    if sys.executable and Path(sys.executable).name.startswith("python"):
        return sys.executable
    found = shutil.which("python3")
    if found is None:
        raise RuntimeError(f"no Python interpreter found for the engine process: set {PYTHON_ENV}")
    return found


class EngineProcess:
    def __init__(
        self,
        config: EngineConfig,
        sink: RequestSink,
        python: str | None = None,
        command_timeout_s: float = 300.0,
        max_restarts: int = MAX_RESTARTS,
        write_back_registry: bool = False,
        watchdog_s: float | None = None,
        registry_journal: str | Path | None = None,
        restarts_before: int = 0,
        peer: PeerSettings | None = None,
    ) -> None:
        """Every output goes to `sink`. `watchdog_s`: kill an engine process whose loop has not gone round for
        that long, or that has sent nothing (not even a heartbeat) for that long: hung, deadlocked or stopped; it
        then fails its requests and is restarted like one that died. `registry_journal`: a file that keeps the
        runtime registrations for an EngineProcess started again later (a reloaded model), given back once the
        first engine is ready. `restarts_before`: restarts counted before this EngineProcess (its engine_restarts
        statistic goes on). `peer`: take peer models' requests too (peers.py)."""
        if write_back_registry and not config.adapter_registry:
            raise ValueError("write_back_registry needs the multi_lora.json to write to: set adapter_registry")
        self._config = config
        self._peer = peer
        self._context = multiprocessing.get_context("spawn")
        self._context.set_executable(python or interpreter())
        self._command_timeout_s = command_timeout_s
        self._restarts_left = max_restarts
        self.restarts = restarts_before
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._sink = sink
        self._calls: dict[int, tuple[Future, AdapterCommand]] = {}
        # Runtime registrations, given back to every new engine process (and written to the multi_lora.json)
        self.registry = RuntimeRegistry(config.adapter_registry if write_back_registry else None, registry_journal)
        self._call_ids = itertools.count()
        self._listeners: list[StatsListener] = []
        self._peer_listeners: list[EventsListener] = []
        self._closed: str | None = None  # why requests are refused while no engine process serves them
        self._stopping = False
        self._counted_before = {key: 0 for key in STATS_COUNTERS}  # by engine processes that exited
        self._watchdog_s = watchdog_s
        self._heard_at = time.monotonic()  # the last message from the engine process
        self._loop_beat_age = 0.0  # as of that message
        self._kill_reason: str | None = None  # why the watchdog killed the engine process
        self._starting = True
        self._failed: str | None = None  # why no engine process will serve again
        self._start()
        self._give_back_registrations()
        self._starting = False
        if watchdog_s is not None:
            threading.Thread(target=self._watch, name="slora-engine-watchdog", daemon=True).start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _start(self) -> None:
        """Start an engine process and wait until it is ready (raises if it fails); then receive its outputs."""
        requests_reader, requests = self._context.Pipe(duplex=False)
        outputs, outputs_writer = self._context.Pipe(duplex=False)
        arguments = (self._config, requests_reader, outputs_writer, self._peer)
        process = self._context.Process(target=worker_main, args=arguments, name="slora-engine", daemon=True)
        process.start()
        requests_reader.close()
        outputs_writer.close()
        with self._send_lock:
            self._process, self._requests, self._outputs = process, requests, outputs
        self.info, stats = self._wait_ready()
        self._heard_at, self._loop_beat_age, self._kill_reason = time.monotonic(), 0.0, None
        self._stats = self._cumulative(stats)
        self._receiver = threading.Thread(target=self._receive, name="slora-engine-receiver", daemon=True)
        self._receiver.start()

    def submit(self, job: Submission) -> None:
        """Send `job` to the engine process; refused at once while none serves. A job sent just as the process
        dies is lost with it: the sink, which knew of it before this call, fails it in `fail_all`."""
        closed = self._closed
        if closed is not None:
            deliver_each(self._sink, [failed_output(job.request_id, EngineOverloadedError(closed), "rejected")])
            return
        self._send(SubmitMsg(job))

    def abort(self, request_id: str) -> None:
        self._send(AbortMsg(request_id))

    def command(self, command: AdapterCommand) -> dict[str, Any]:
        return self._call(command, refuse_when_closed=True)

    def _call(self, command: AdapterCommand, refuse_when_closed: bool) -> dict[str, Any]:
        """Send `command` to the engine process and wait for its answer (the restart, which gives the registry
        back while requests are still refused, calls with refuse_when_closed=False)."""
        future: Future = Future()
        with self._lock:
            if refuse_when_closed and self._closed is not None:
                raise EngineOverloadedError(self._closed)
            call_id = next(self._call_ids)
            self._calls[call_id] = (future, command)
        self._send(CommandMsg(call_id, command))
        return future.result(self._command_timeout_s)

    def stats(self) -> EngineStats:
        return self._stats

    def on_stats(self, listener: StatsListener) -> None:
        self._listeners.append(listener)

    def on_peer_events(self, listener: EventsListener) -> None:
        """`listener` gets the request metrics of the peer models' requests (peers.py)."""
        self._peer_listeners.append(listener)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the engine (it aborts what is left; those outputs are delivered), then the process."""
        self._stopping = True
        self._send(StopMsg())
        self._receiver.join(timeout)
        self._process.join(timeout)
        if self._process.is_alive():
            logger.warning("the engine process did not stop in %.0f s; killing it", timeout)
            self._process.kill()
            self._process.join(5)
        self._requests.close()

    # ---- the receiver thread -----------------------------------------------------------------------------------

    def _wait_ready(self) -> tuple[EngineInfo, EngineStats]:
        """Relay the start-up log until the engine is ready; raise with its reason if it fails or dies."""
        while True:
            if not self._outputs.poll(1.0):
                if not self._process.is_alive():
                    raise RuntimeError(
                        f"the engine process exited with code {self._process.exitcode} while starting (see the log)"
                    )
                continue
            message = self._outputs.recv()
            if isinstance(message, LogMsg):
                _relay(message.records)
            elif isinstance(message, ReadyMsg):
                return message.info, message.stats
            elif isinstance(message, FailedMsg):
                self._process.join(10)
                raise RuntimeError(f"the engine failed to start: {message.reason}")

    def _receive(self) -> None:
        while True:
            try:
                message = self._outputs.recv()
            except (EOFError, OSError):
                break
            self._heard_at = time.monotonic()
            if isinstance(message, HeartbeatMsg):
                self._loop_beat_age = message.loop_beat_age_s
            elif isinstance(message, OutputsMsg):
                self._deliver(message.outputs, message.stats)
            elif isinstance(message, LogMsg):
                _relay(message.records)
            elif isinstance(message, ResultMsg):
                self._resolve(message)
            elif isinstance(message, PeerEventsMsg):
                for listener in self._peer_listeners:
                    listener(message.events)
            elif isinstance(message, StoppedMsg):
                break
            elif isinstance(message, FatalMsg):  # it exits next: its requests fail with this reason
                self._kill_reason = message.reason
        self._process.join(5 if self._stopping else 1)
        self._close()
        if not self._stopping and self._restarts_left > 0:
            self._restart()
        elif not self._stopping:
            self._failed = self._closed

    def _deliver(self, outputs: list[RequestOutput], stats: EngineStats | None) -> None:
        deliver_each(self._sink, outputs)
        if stats is not None:
            self._stats = stats = self._cumulative(stats)
            for listener in self._listeners:
                listener(stats)

    def _resolve(self, result: ResultMsg) -> None:
        with self._lock:
            future, command = self._calls.pop(result.call_id, (None, None))
        if future is None or command is None:
            return
        if result.error is None:
            # Recorded here, on the receiver thread, in the order the engine carried the commands out
            self.registry.record(command)
            future.set_result(result.value)
        else:
            future.set_exception(result.error)

    def _close(self) -> None:
        """The process is gone: end every request and command still waiting on it."""
        if self._stopping:
            reason = "the engine has stopped"
        else:
            reason = self._kill_reason or f"the engine process exited unexpectedly (exit code {self._process.exitcode})"
            reason += "; restarting it" if self._restarts_left else ""
            logger.error("%s; failing the requests in flight", reason)
        with self._lock:
            self._closed = reason
            calls, self._calls = self._calls, {}
        failure = RuntimeError(reason)
        try:
            self._sink.fail_all(failure)
        except Exception:
            logger.exception("failing the requests in flight failed")
        for future, _command in calls.values():
            future.set_exception(failure)

    def _restart(self) -> None:
        """Start a new engine process (on this, the old receiver's, thread); requests wait for none meanwhile:
        they are refused (UNAVAILABLE) until it is ready and has the runtime registrations back."""
        self._restarts_left -= 1
        self.restarts += 1
        self._starting = True
        self._counted_before = {key: getattr(self._stats, key) for key in STATS_COUNTERS}
        logger.warning("starting a new engine process (%d more restarts allowed)", self._restarts_left)
        try:
            self._start()
            self._give_back_registrations()
        except Exception as exc:
            logger.error("the engine could not be restarted: %s", exc)
            with self._lock:
                self._closed = self._failed = f"the engine process exited and could not be restarted: {exc}"
            return
        finally:
            self._starting = False
        with self._lock:
            self._closed = None
        logger.info("the engine process is serving again (restart %d)", self.restarts)

    def _give_back_registrations(self) -> None:
        """Re-apply the runtime registrations to the new engine process, before it serves. One that fails now
        (its folder removed since, say) is logged and forgotten; the others still apply."""
        commands = self.registry.replay()
        for command in commands:
            assert command.name is not None  # RuntimeRegistry records named commands only
            try:
                self._call(command, refuse_when_closed=False)
            except AdapterNotFoundError:
                if command.op != "unload":  # an unload of a name this engine never had: nothing to undo
                    self._forget(command, "is not found")
            except AdapterError as exc:  # this adapter only; any other error (the process died) ends the restart
                self._forget(command, str(exc))
        if commands:
            logger.info("gave the new engine process back %d runtime adapter registrations", len(commands))

    def _forget(self, command: AdapterCommand, reason: str) -> None:
        assert command.name is not None
        self.registry.forget(command.name)
        logger.error("adapter %r, registered at runtime (%s %s), is lost with the restart: %s", command.name,
                     command.op, command.path or "", reason)  # fmt: skip

    def health(self) -> EngineHealth:
        if self._stopping:
            return EngineHealth("stopped", "the engine has stopped")
        if self._failed is not None:
            return EngineHealth("failed", self._failed)
        closed = self._closed
        if closed is not None or self._starting:
            return EngineHealth("restarting", closed or "the engine process is starting")
        return EngineHealth("serving")

    def _watch(self) -> None:
        """The watchdog: kill an engine process that stopped going round its loop or stopped talking."""
        assert self._watchdog_s is not None
        while not self._stopping and self._failed is None:
            time.sleep(min(1.0, self._watchdog_s / 4))
            if self._starting or self._closed is not None or self._kill_reason is not None:
                continue
            silent = time.monotonic() - self._heard_at
            stuck = max(silent, self._loop_beat_age)
            if stuck > self._watchdog_s:
                self._kill_hung(stuck)

    def _kill_hung(self, stuck: float) -> None:
        self._kill_reason = (f"the engine process did not respond for {stuck:.0f} s (watchdog_timeout_s="
                             f"{self._watchdog_s:g}) and was killed")  # fmt: skip
        logger.error("%s; its requests fail", self._kill_reason)
        self._process.kill()  # SIGKILL ends a stopped (SIGSTOP) process too; the receiver sees the pipe close

    def _cumulative(self, stats: EngineStats) -> EngineStats:
        """`stats` with the counters continued from engine processes that exited, and the restart count."""
        counters = {key: getattr(stats, key) + self._counted_before[key] for key in STATS_COUNTERS}
        return replace(stats, engine_restarts=self.restarts, **counters)

    def _send(self, message: ToEngine) -> None:
        with self._send_lock:
            try:
                self._requests.send(message)
            except (OSError, ValueError):  # the process is gone: the receiver thread fails what is in flight
                logger.debug("engine process pipe closed; %s not sent", type(message).__name__)


def _relay(records: list[LogRecord]) -> None:
    for record in records:
        logging.getLogger(record.logger).log(record.level, "%s", record.message)
