"""Torch CPU work off the engine thread, on threads that exit when it is done.

PyTorch's CPU ops go parallel through OpenMP (libgomp), which gives every thread that runs a parallel region a
thread team of its own, kept until that thread exits. Once there are more OpenMP threads than cores, libgomp
throttles its threads' spin-waiting for good, and every small parallel region pays for waking its team. On the
2-core CPU machine the engine thread's decode steps then ran 3.5x slower (tiny-deep, 32 sequences: 57 -> 200 ms
a step) when the engine had been built on another, still living thread, and its small GEMMs 2.5-4x slower after
any second thread had run one torch op (perf/RESULTS.md).

So a server builds its engine, and reads adapters from disk, on threads that end afterwards: their teams go
with them and the engine thread's team is the only one left. A thread costs ~0.1 ms to start, against
milliseconds for either job.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


def run_in_fresh_thread(fn: Callable[[], T], name: str = "slora-build") -> T:
    """fn() on a new thread, waited for; its result, or its exception raised here."""
    future: Future[T] = Future()
    future.set_running_or_notify_cancel()  # nobody else holds it: it cannot have been cancelled
    thread = threading.Thread(target=_run_into, args=(future, fn), name=name, daemon=True)
    thread.start()
    thread.join()
    return future.result()


class FreshThreadExecutor:
    """Like a ThreadPoolExecutor of `max_workers`, but each task runs on a new thread that ends with it. Tasks start
    in submission order, at most max_workers at once (with 1: one after the other, in order)."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self._slots = threading.Semaphore(max_workers)
        self._prefix = thread_name_prefix
        self._tasks: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._running: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._count = 0
        self._dispatcher = threading.Thread(target=self._dispatch, name=f"{thread_name_prefix}-dispatch", daemon=True)
        self._dispatcher.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot submit after shutdown")
            self._tasks.put((future, lambda: fn(*args)))
        return future

    def shutdown(self, wait: bool = True) -> None:
        """No new tasks; the queued ones still run. With wait, returns once every task has finished."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._tasks.put(None)
        if wait:
            self._dispatcher.join()
            for thread in list(self._running):
                thread.join()

    def _dispatch(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, fn = task
            self._slots.acquire()
            if not future.set_running_or_notify_cancel():
                self._slots.release()
                continue
            self._count += 1
            thread = threading.Thread(target=self._run, args=(future, fn), name=f"{self._prefix}_{self._count}")
            with self._lock:
                self._running.add(thread)
            try:
                thread.start()
            except RuntimeError as exc:  # no thread to be had (resource limits): this task fails, later ones may run
                with self._lock:
                    self._running.discard(thread)
                self._slots.release()
                future.set_exception(exc)

    def _run(self, future: Future[Any], fn: Callable[[], Any]) -> None:
        try:
            _run_into(future, fn)
        finally:
            with self._lock:
                self._running.discard(threading.current_thread())
            self._slots.release()


def _run_into(future: Future[T], fn: Callable[[], T]) -> None:
    """fn()'s result or exception into `future`, already set running."""
    try:
        result = fn()
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
        future.set_exception(exc)
    else:
        future.set_result(result)
