"""A tenant replay spread over client processes: each process sends its tenants' requests and reads their responses,
as separate customers' clients would, on one clock.

One Python process reading every tenant's streamed responses measures itself as well as the server: each engine
step sends a burst of responses, one a request, and a first token can wait behind the others of its burst in the
client's event loop. A noisy tenant's responses could then delay the light tenants' first tokens in the client
alone. So the heavy tenants get a process of their own and the others are shared round robin over the rest: the
light tenants' clients do the same work with the noisy tenant and without it.

Every process's replay starts on the same `time.perf_counter()` instant (CLOCK_MONOTONIC, one clock for all
processes of the machine), so arrival times, first tokens and finishes of all processes are on one time line. That
instant is set once every process has connected to the server (a process that starts late would send its first
requests late, and their first tokens would count the delay).

    workers = ClientWorkers(3)                 # started once (spawn), reused by every run
    result = workers.replay(job, parts)        # one part of the trace a process
    workers.close()
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time
from collections import Counter
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from perf.bench_serving import Client, ReplayResult, ServingOptions, StreamReplay, measured
from perf.metrics import RequestRecord
from perf.tenant_measures import tenant_of
from perf.triton_protocol import ModelIO, Target
from perf.workload import TraceRequest

logger = logging.getLogger(__name__)

HEAVY = 2.0  # a tenant with more than this many times the median tenant's requests gets the heavy tenants' client
LEAD_S = 0.2  # from the last process's "connected" to the clock's start: the start instant reaches every process
CONNECTED = "connected"


def assign_clients(requests: list[TraceRequest], clients: int) -> list[list[TraceRequest]]:
    """The requests of each client process, in arrival order. With two clients or more, the heavy tenants (more than
    HEAVY times the median tenant's requests) share the first and the others go round robin over the rest in the
    order of their names, so that a light tenant has the same client in a run with a noisy tenant as without it.
    Empty parts are left out."""
    if clients < 1:
        raise ValueError(f"clients must be >= 1, got {clients}")
    counts = Counter(tenant_of_request(r) for r in requests)
    if clients == 1 or len(counts) < 2:
        return [list(requests)] if requests else []
    median = float(np.median(list(counts.values())))
    light = sorted(t for t, n in counts.items() if n <= HEAVY * median)
    client_of = {tenant: 1 + i % (clients - 1) for i, tenant in enumerate(light)}
    parts: list[list[TraceRequest]] = [[] for _ in range(clients)]
    for r in requests:
        parts[client_of.get(tenant_of_request(r), 0)].append(r)
    return [part for part in parts if part]


def tenant_of_request(r: TraceRequest) -> str:
    return tenant_of(RequestRecord(r.index, r.adapter, r.input_len, r.output_len, r.arrival))


@dataclass(frozen=True)
class ReplayJob:
    """What every client process of one run needs, but its requests: a replay class (StreamReplay or a subclass,
    importable by name) and its arguments."""

    replay_class: type[StreamReplay]
    url: str
    target: Target
    io: ModelIO
    options: ServingOptions
    max_tokens: int | None = None
    stream_a_tenant: bool = False  # each client opens one stream per tenant of its part (options.streams ignored)
    ready_timeout_s: float = 60.0  # for the server to answer a client before its clock starts

    def options_for(self, requests: list[TraceRequest], start_at: float | None) -> ServingOptions:
        streams = (len({tenant_of_request(r) for r in requests}) or 1) if self.stream_a_tenant else self.options.streams
        return replace(self.options, streams=streams, start_at=start_at)


async def replay_part(job: ReplayJob, requests: list[TraceRequest], conn: Connection) -> ReplayResult:
    """`requests` replayed by one client of its own: it connects, says so on `conn`, and starts its clock at the
    perf_counter instant that `conn` then gives (None: another process could not connect; nothing is sent)."""
    client = Client(job.url)
    try:
        await client.wait_ready(job.target.model, job.ready_timeout_s)
        conn.send(CONNECTED)
        start_at = conn.recv()
        if start_at is None:
            raise RuntimeError("not run: another client process could not connect")
        replay = job.replay_class(client, job.target, job.io, requests, job.options_for(requests, start_at), None,
                                  count_words, job.max_tokens)  # fmt: skip
        return await measured(replay)
    finally:
        await client.close()


def count_words(text: str) -> int:
    return len(text.split())


class ClientWorkers:
    """`count` client processes (spawned once; each runs one part of a run at a time, on an event loop of its own)."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"client processes must be >= 1, got {count}")
        context = multiprocessing.get_context("spawn")  # no copy of the parent's event loop or gRPC channels
        self._conns: list[Connection] = []
        self._procs = []
        for i in range(count):
            parent, child = context.Pipe()
            proc = context.Process(target=_serve_jobs, args=(child,), name=f"tenant-client-{i}", daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)

    @property
    def count(self) -> int:
        return len(self._procs)

    def replay(self, job: ReplayJob, parts: list[list[TraceRequest]]) -> ReplayResult:
        """Each part on its own process, all on one clock that starts once all have connected; the merged result.
        Every process's answers are read before a failure is raised, so none is left for the next run."""
        if not 1 <= len(parts) <= self.count:
            raise ValueError(f"{len(parts)} parts for {self.count} client processes")
        conns = self._conns[: len(parts)]
        for conn, part in zip(conns, parts):
            conn.send((job, part))
        connected = [self._receive(conn) for conn in conns]
        failed = [c for c in connected if c != CONNECTED]
        start_at = None if failed else time.perf_counter() + LEAD_S
        for conn, answer in zip(conns, connected):
            if answer == CONNECTED:
                conn.send(start_at)
        outcomes = [self._receive(conn) if answer == CONNECTED else answer for conn, answer in zip(conns, connected)]
        for outcome in [*failed, *outcomes]:  # a failure to connect first: the others' is only its consequence
            if isinstance(outcome, BaseException):
                raise RuntimeError(f"a tenant client process failed: {outcome!r}") from outcome
        return ReplayResult.merged([o for o in outcomes if isinstance(o, ReplayResult)])

    def _receive(self, conn: Connection) -> Any:
        try:
            return conn.recv()
        except EOFError:
            return RuntimeError("the process died during its replay")

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
        for conn in self._conns:
            conn.close()


def _serve_jobs(conn: Connection) -> None:
    """A client process: replays each job it is sent, returns its result (or the exception), until None comes."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(processName)s %(name)s %(message)s")
    while True:
        message: Any = conn.recv()
        if message is None:
            return
        job, requests = message
        try:
            result: ReplayResult | BaseException = asyncio.run(replay_part(job, requests, conn))
        except Exception as exc:  # told to the parent, which raises it for the run (as text: gRPC's may not pickle)
            logger.exception("tenant client replay failed")
            result = RuntimeError(f"{type(exc).__name__}: {exc}")
        conn.send(result)
