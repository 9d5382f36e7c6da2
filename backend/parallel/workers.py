"""Rank 0's side of tensor parallelism: the worker processes of ranks 1 .. n-1, their channels, their deaths.

    rank 0 (the engine's process)                         rank i (a worker process, follower.py)
      start(): spawn, FollowerSetup ──── channel ────►      HelloMsg, then joins the group
               every rank joins the group (collectives.py) and loads its shard; pools agree on a page count
               ◄──── ReadyMsg (or FailedMsg: why it could not start)
      each step: StepMsg (pool events + plan) ──────►      replays, follows the forward
      check_integrity(): SyncMsg ───────────────────►      replays, checks its pool: SyncReply
      close(): StopMsg ─────────────────────────────►      exits

Workers are started with subprocess (the engine's process is a daemonic multiprocessing child, which may not have
children of its own), from the engine's interpreter and sys.path. A worker exits when its channel closes or its
parent changes (rank 0 is gone). A reader thread per worker reads its replies; when one dies (its channel closes),
the group records why (WorkerDiedError, naming the rank, pid and exit code), kills the other workers (they may be
blocked in a collective) and calls `on_failure`: the engine process sets it to end itself with that reason, which
fails the requests in flight and has the engine restarted (runtime/engine_worker.py).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from slora.backend.config import EngineConfig
from slora.backend.memory.page_pool import PoolIntegrityError
from slora.backend.parallel.collectives import Collectives, serve_store
from slora.backend.parallel.messages import (
    FailedMsg,
    FollowerSetup,
    FromFollower,
    HelloMsg,
    PoolEvent,
    ReadyMsg,
    StepMsg,
    StepPlan,
    StopMsg,
    SyncMsg,
    SyncReply,
)
from slora.backend.parallel.pool_mirror import MirroredPagePool

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 900.0  # a worker loading its shard of a large checkpoint from a slow disk
REPLY_TIMEOUT_S = 120.0  # an integrity check's replies (a worker may first read an adapter from disk)
DEATH_WAIT_S = 5.0  # how long a failed collective waits for the dead worker to be identified
STOP_TIMEOUT_S = 10.0


class TensorParallelError(RuntimeError):
    """The tensor-parallel group can run no more steps (its ranks are no longer in step with each other)."""


class WorkerDiedError(TensorParallelError):
    """A tensor-parallel worker process exited."""


@dataclass
class _Worker:
    rank: int
    process: subprocess.Popen
    conn: Connection
    failed: str | None = None  # what the worker said before it exited (FailedMsg)


class WorkerGroup:
    """Ranks 1 .. n-1 of an engine whose rank 0 is this process (see top)."""

    def __init__(self, size: int, workers: list[_Worker], comm: Collectives, store: dist.Store) -> None:
        self.size = size
        self.comm = comm
        self._store = store  # rank 0 serves the group's rendezvous store: kept while the group lives
        self.pool: MirroredPagePool | None = None  # rank 0's, attached once built: its events go with each step
        self.on_failure: Callable[[str], None] | None = None  # called (on a reader thread) when a worker dies
        self.failure: str | None = None  # why the group cannot run: the first worker death, or rank 0's failed step
        self._died = False  # whether `failure` is a worker's death
        self._workers = workers
        self._replies: queue.Queue[SyncReply] = queue.Queue()
        self._ready: queue.Queue[int] = queue.Queue()
        self._lock = threading.Lock()
        self._closing = False
        self._unsynced = True  # the pool changed (or was never compared) since the last integrity check
        for worker in workers:
            threading.Thread(target=self._read, args=(worker,), name=f"slora-tp-{worker.rank}", daemon=True).start()
        atexit.register(self.close)

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(w.process.pid for w in self._workers)

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> WorkerGroup:
        """Spawn the workers, wait for each to be alive, and join the group with them (rank 0 on `device`)."""
        size = config.tensor_parallel_size
        store = serve_store(size)
        workers = [_spawn(config, rank, size, store.port) for rank in range(1, size)]
        try:
            for worker in workers:
                hello = _hello(worker)
                logger.info("tensor-parallel worker rank %d started (pid %d)", worker.rank, hello.pid)
            comm = Collectives.connect(store, 0, size, device)
        except BaseException:
            _kill(workers)
            raise
        return cls(size, workers, comm, store)

    def wait_ready(self) -> None:
        """Wait until every worker has built its shard and pool; raise WorkerDiedError naming one that failed."""
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = {w.rank for w in self._workers}
        while pending:
            if self.failure is not None:
                raise WorkerDiedError(self.failure)
            try:
                pending.discard(self._ready.get(timeout=0.2))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise WorkerDiedError(f"tensor-parallel workers {sorted(pending)} did not start") from None

    def attach(self, pool: MirroredPagePool) -> None:
        self.pool = pool

    # ---- each step ------------------------------------------------------------------------------------------

    def send_step(self, plan: StepPlan) -> None:
        """Tell every worker the step (and the pool's changes before it); the forward follows on every rank."""
        self._check_alive()
        self._send(StepMsg(self._take_events(), plan))

    def check_integrity(self) -> None:
        """Rank 0's pool, then every worker's after replaying it, checked and compared with rank 0's page table;
        raises PoolIntegrityError naming the rank. Nothing is sent when nothing changed since the last check."""
        pool = self._pool()
        pool.check_integrity()
        if not self._unsynced and not pool.events:
            return
        self._check_alive()
        self._send(SyncMsg(self._take_events(), pool.digest()))
        errors = []
        for _ in self._workers:
            reply = self._reply()
            if reply.error is not None:
                errors.append(f"rank {reply.rank}: {reply.error}")
        self._unsynced = False
        if errors:
            raise PoolIntegrityError("; ".join(errors))

    def error_for(self, exc: BaseException) -> TensorParallelError:
        """The error to raise for a step that failed with `exc` on rank 0: the worker death behind it (waiting a
        little for it to be identified), else `exc` itself, after which the group is given up: the workers may be
        waiting in a collective rank 0 will never reach, and the next step's would be paired with it."""
        deadline = time.monotonic() + DEATH_WAIT_S
        while self.failure is None and time.monotonic() < deadline and not self._closing:
            time.sleep(0.05)
        if self.failure is None:
            self._give_up(f"rank 0's step failed ({type(exc).__name__}: {exc}); the workers were stopped")
        assert self.failure is not None
        return (WorkerDiedError if self._died else TensorParallelError)(self.failure)

    # ---- stopping and failing -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers (killed if they do not exit in time); the group cannot run steps afterwards."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        for worker in self._workers:
            _send_quietly(worker.conn, StopMsg())
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for worker in self._workers:
            try:
                worker.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel worker rank %d did not stop; killing it", worker.rank)
        _kill(self._workers)
        for worker in self._workers:
            worker.conn.close()
        atexit.unregister(self.close)

    def _read(self, worker: _Worker) -> None:
        """A worker's replies, until its channel closes: then it has exited (or is about to)."""
        while True:
            try:
                message: FromFollower = worker.conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, SyncReply):
                self._replies.put(message)
            elif isinstance(message, ReadyMsg):
                self._ready.put(message.rank)
            elif isinstance(message, FailedMsg):
                worker.failed = message.reason
        if not self._closing:
            self._lost(worker)

    def _lost(self, worker: _Worker) -> None:
        try:
            code: int | None = worker.process.wait(DEATH_WAIT_S)
        except subprocess.TimeoutExpired:
            code = None
        reason = (f"tensor-parallel worker rank {worker.rank} (pid {worker.process.pid}) "
                  + (f"exited with code {code}" if code is not None else "closed its channel"))  # fmt: skip
        if worker.failed:
            reason += f": {worker.failed}"
        self._give_up(reason, died=True)

    def _give_up(self, reason: str, died: bool = False) -> None:
        """Record why no step can run any more, stop every worker, and tell `on_failure` (once)."""
        with self._lock:
            if self.failure is not None or self._closing:
                return
            self.failure, self._died = reason, died
        logger.error("%s; the engine cannot run another step", reason)
        if self.comm.device.type == "cuda":
            self.comm.abort()  # NCCL waits for a dead rank forever; gloo's collectives fail by themselves
        _kill(self._workers)
        if self.on_failure is not None:
            self.on_failure(reason)

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise (WorkerDiedError if self._died else TensorParallelError)(self.failure)
        if self._closing:
            raise TensorParallelError("the tensor-parallel workers have been stopped")

    def _pool(self) -> MirroredPagePool:
        if self.pool is None:
            raise RuntimeError("no page pool attached to the tensor-parallel group")
        return self.pool

    def _take_events(self) -> list[PoolEvent]:
        events = self._pool().take_events()
        if events:
            self._unsynced = True
        return events

    def _send(self, message: StepMsg | SyncMsg) -> None:
        for worker in self._workers:
            try:
                worker.conn.send(message)
            except (OSError, ValueError) as exc:  # its channel is closed: it died, and _read records why
                raise self.error_for(exc) from exc

    def _reply(self) -> SyncReply:
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while True:
            self._check_alive()
            try:
                return self._replies.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise WorkerDiedError("a tensor-parallel worker did not answer the integrity check") from None


def _spawn(config: EngineConfig, rank: int, size: int, store_port: int) -> _Worker:
    """Start rank `rank`'s process with the engine's interpreter and sys.path; hand it its setup."""
    from slora.backend.runtime.engine_process import interpreter  # runtime imports the engine, which imports us

    ours, theirs = socket.socketpair()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    command = [interpreter(), "-m", "slora.backend.parallel.follower", str(theirs.fileno())]
    process = subprocess.Popen(command, pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
    theirs.close()
    conn = Connection(ours.detach())
    conn.send(FollowerSetup(config, rank, size, store_port))
    return _Worker(rank, process, conn)


def _hello(worker: _Worker) -> HelloMsg:
    """The worker's first message; raise WorkerDiedError if it fails or exits first (see its log)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    where = f"tensor-parallel worker rank {worker.rank}"
    while not worker.conn.poll(0.2):
        code = worker.process.poll()
        if code is not None:
            raise WorkerDiedError(f"{where} exited with code {code} while starting (see its log)")
        if time.monotonic() > deadline:
            raise WorkerDiedError(f"{where} did not answer within {START_TIMEOUT_S:.0f} s of starting")
    message = worker.conn.recv()
    if isinstance(message, FailedMsg):
        raise WorkerDiedError(f"{where} failed while starting: {message.reason}")
    if not isinstance(message, HelloMsg):
        raise WorkerDiedError(f"{where} sent {type(message).__name__} before HelloMsg")
    return message


def _send_quietly(conn: Connection, message: StopMsg) -> None:
    try:
        conn.send(message)
    except (OSError, ValueError):
        pass


def _kill(workers: list[_Worker]) -> None:
    for worker in workers:
        if worker.process.poll() is None:
            worker.process.kill()
            worker.process.wait()
