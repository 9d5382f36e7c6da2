"""What a server needs from an engine, and the engine in the server's own process (`LocalEngine`).

A server hands the engine `Submission`s, aborts them, asks adapter commands, and reads statistics; every output
goes to the sink the engine was started with (output_sink.py). Two implementations: `LocalEngine` runs the
`EngineLoop` on a thread of the calling process, and `EngineProcess` (engine_process.py) runs a `LocalEngine` in
a process of its own, so that the engine's Python work and the server's response work do not share one GIL.

Every refusal reaches the sink as the request's final output with finish_reason "rejected" (bad input, unknown
adapter, full queue): callers never see an exception from `submit`, whichever implementation runs the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.outputs import EngineStats, failed_output
from slora.backend.errors import SloraError
from slora.backend.runtime.adapter_admin import run_adapter_command
from slora.backend.runtime.engine_loop import EngineLoop
from slora.backend.runtime.fresh_threads import FreshThreadExecutor, run_in_fresh_thread
from slora.backend.runtime.gc_freeze import freeze_startup_objects
from slora.backend.runtime.gc_threshold import raise_young_threshold
from slora.backend.runtime.messages import AdapterCommand, EngineInfo, Submission
from slora.backend.runtime.output_sink import OutputSink, deliver_each

logger = logging.getLogger(__name__)

INTAKE_THREADS = 4  # requests whose adapter must first be read from disk are taken in off the caller's thread
StatsListener = Callable[[EngineStats], None]


@dataclass(frozen=True)
class EngineHealth:
    """Whether the engine serves: "serving", "restarting" (an engine process is being started again), "failed"
    (it will not serve again: dead past its restarts, or hung), or "stopped"; `reason` says why when not serving."""

    state: str
    reason: str = ""

    @property
    def serving(self) -> bool:
        return self.state == "serving"


class EngineService(Protocol):
    info: EngineInfo

    def health(self) -> EngineHealth: ...

    def submit(self, job: Submission) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def command(self, command: AdapterCommand) -> dict[str, Any]: ...

    def stats(self) -> EngineStats: ...

    def on_stats(self, listener: StatsListener) -> None: ...

    def stop(self) -> None: ...


class LocalEngine:
    """The engine loop on a thread of this process; cold adapters are read in a small intake pool."""

    @classmethod
    def start(cls, config: EngineConfig, sink: OutputSink, watchdog_s: float | None = None) -> LocalEngine:
        """A server's engine: built on a thread that ends afterwards (fresh_threads.py says why), then the
        start-up objects frozen out of the garbage collector's reach (gc_freeze.py) and its young collections made
        rare (gc_threshold.py)."""
        service = cls(run_in_fresh_thread(lambda: LLMEngine(config)), sink, watchdog_s=watchdog_s)
        freeze_startup_objects()
        raise_young_threshold()
        return service

    def __init__(
        self,
        engine: LLMEngine,
        sink: OutputSink,
        intake_threads: int = INTAKE_THREADS,
        watchdog_s: float | None = None,
    ) -> None:
        self._sink = sink
        self.loop = EngineLoop(engine, sink)
        self._watchdog_s = watchdog_s
        pids = engine.parallel.pids if engine.parallel is not None else ()
        self.info = EngineInfo(engine.pool.num_pages, engine.max_model_len, len(engine.list_adapters()), pids,
                               engine.config.max_num_seqs or 0, engine.config.max_batch_tokens or 0)  # fmt: skip
        # Adapter reads run torch CPU ops: on threads that end with them (fresh_threads.py says why)
        self._intake = FreshThreadExecutor(max_workers=intake_threads, thread_name_prefix="slora-intake")
        self.loop.start()

    def submit(self, job: Submission) -> None:
        """Queue `job`; if taking it in may read its adapter from disk, that happens in the intake pool so that the
        requests after it are taken in meanwhile."""
        if job.adapter and self.loop.engine.store.reads_on_intake(job.adapter):
            self._intake.submit(self._submit, job)
        else:
            self._submit(job)

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    def health(self) -> EngineHealth:
        """Failed when the engine thread has died, or has not gone round its loop for watchdog_s (a thread cannot
        be killed: the server replaces the whole model)."""
        if not self.loop.alive():
            return EngineHealth("failed", "the engine thread has stopped")
        workers = self.loop.engine.parallel
        if workers is not None and workers.failure is not None:  # no step can run: the server reloads the model
            return EngineHealth("failed", workers.failure)
        age = self.loop.beat_age()
        if self._watchdog_s is not None and age > self._watchdog_s:
            return EngineHealth(
                "failed", f"the engine did not respond for {age:.0f} s (watchdog {self._watchdog_s:g} s)"
            )
        return EngineHealth("serving")

    def command(self, command: AdapterCommand) -> dict[str, Any]:
        return run_adapter_command(self.loop, command)

    def stats(self) -> EngineStats:
        return self.loop.stats()

    def on_stats(self, listener: StatsListener) -> None:
        self.loop.stats_listeners.append(listener)

    def stop(self) -> None:
        self._intake.shutdown(wait=True)
        self.loop.stop()
        if self.loop.engine.parallel is not None:
            self.loop.engine.parallel.close()

    def _submit(self, job: Submission) -> None:
        try:
            self.loop.submit(job.prompt_ids, job.adapter, job.sampling, job.request_id, job.detokenize,
                             tenant=job.tenant, priority=job.priority, ttft_slo_s=job.ttft_slo_s)  # fmt: skip
        except Exception as exc:  # this request only: its final output carries the message
            if not isinstance(exc, (SloraError, ValueError)):
                logger.error("unexpected error while taking in request %s", job.request_id, exc_info=exc)
            deliver_each(self._sink, [failed_output(job.request_id, exc, "rejected")])
