"""Taking in a replay's requests whose adapter must first be read from disk, off the replay's thread.

A served engine reads a cold adapter (not in host memory) on an intake thread while its loop goes on stepping
(backend/engine_service.LocalEngine). The in-process replay does the same, so that a run whose adapters do not all
fit in host memory measures the engine, not a loop stopped for each read: `start` prepares such a request (checks
and adapter read, LLMEngine.prepare, which is thread-safe) on one of INTAKE_THREADS threads, and `ready` hands the
prepared requests, or their errors, back to the replay's thread, which submits them.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait

from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.request import Request
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.runtime.engine_service import INTAKE_THREADS
from slora.backend.runtime.fresh_threads import FreshThreadExecutor


class ReplayIntake:
    def __init__(self, engine: LLMEngine, threads: int = INTAKE_THREADS) -> None:
        self.engine = engine
        self._threads = threads
        self._pool: FreshThreadExecutor | None = None  # started on the first cold adapter
        self._inflight: dict[str, Future[Request]] = {}

    def __len__(self) -> int:
        return len(self._inflight)

    def is_cold(self, adapter: str) -> bool:
        """Whether a request for `adapter` must wait for a read from disk."""
        return not self.engine.store.in_host(adapter)

    def start(self, request_id: str, prompt_ids: Sequence[int], adapter: str, sampling: SamplingParams) -> None:
        """Prepare the request (token ids only, no text decoded) on an intake thread."""
        if self._pool is None:
            self._pool = FreshThreadExecutor(max_workers=self._threads, thread_name_prefix="replay-intake")
        prepare = self.engine.prepare
        self._inflight[request_id] = self._pool.submit(prepare, list(prompt_ids), adapter, sampling, request_id, False)

    def ready(self) -> list[tuple[str, Request | BaseException]]:
        """The requests prepared since the last call, or the error each raised, by request id."""
        done = [rid for rid, future in self._inflight.items() if future.done()]
        results: list[tuple[str, Request | BaseException]] = []
        for rid in done:
            future = self._inflight.pop(rid)
            error = future.exception()
            results.append((rid, error if error is not None else future.result()))
        return results

    def wait(self, timeout: float) -> None:
        """Until a request in flight is prepared, or `timeout` seconds."""
        if self._inflight:
            wait(list(self._inflight.values()), timeout=timeout, return_when=FIRST_COMPLETED)

    def close(self) -> None:
        """Wait for the reads in flight (their requests are dropped) and end the threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._inflight.clear()
