"""fresh_threads: each task on a thread of its own that has ended once its result is in; results and exceptions
reach the caller; at most max_workers at once, in submission order; shutdown runs what was queued."""

from __future__ import annotations

import threading
import time

import pytest

from slora.backend.runtime.fresh_threads import FreshThreadExecutor, run_in_fresh_thread


def _current() -> threading.Thread:
    return threading.current_thread()


def test_run_in_fresh_thread_returns_from_a_thread_that_has_ended() -> None:
    thread = run_in_fresh_thread(_current, name="slora-test")
    assert thread is not threading.current_thread() and thread.name == "slora-test"
    assert not thread.is_alive()


def test_run_in_fresh_thread_raises_the_tasks_error() -> None:
    def fail() -> None:
        raise ValueError("bad adapter")

    with pytest.raises(ValueError, match="bad adapter"):
        run_in_fresh_thread(fail)


def test_every_task_gets_a_new_thread_that_ends_with_it() -> None:
    executor = FreshThreadExecutor(max_workers=2, thread_name_prefix="slora-test")
    threads = [executor.submit(_current).result(timeout=10) for _ in range(4)]
    executor.shutdown(wait=True)
    assert len({id(t) for t in threads}) == 4
    assert all(t.name.startswith("slora-test_") and not t.is_alive() for t in threads)


def test_one_worker_runs_tasks_one_at_a_time_in_order() -> None:
    executor = FreshThreadExecutor(max_workers=1, thread_name_prefix="slora-test")
    order: list[int] = []
    inside = [0]
    most = [0]
    lock = threading.Lock()

    def task(i: int) -> int:
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.01)
        order.append(i)
        with lock:
            inside[0] -= 1
        return i * i

    futures = [executor.submit(task, i) for i in range(6)]
    assert [f.result(timeout=10) for f in futures] == [i * i for i in range(6)]
    executor.shutdown(wait=True)
    assert order == list(range(6)) and most[0] == 1


def test_at_most_max_workers_run_at_once() -> None:
    executor = FreshThreadExecutor(max_workers=2, thread_name_prefix="slora-test")
    release = threading.Event()
    started = threading.Semaphore(0)

    def task() -> None:
        started.release()
        release.wait(10)

    futures = [executor.submit(task) for _ in range(3)]
    assert started.acquire(timeout=10) and started.acquire(timeout=10)
    assert not started.acquire(timeout=0.2), "a third task started while two held both slots"
    release.set()
    for future in futures:
        future.result(timeout=10)
    executor.shutdown(wait=True)


def test_errors_reach_the_future_and_later_tasks_still_run() -> None:
    executor = FreshThreadExecutor(max_workers=1, thread_name_prefix="slora-test")

    def fail() -> None:
        raise RuntimeError("disk gone")

    failed = executor.submit(fail)
    after = executor.submit(lambda: "ok")
    with pytest.raises(RuntimeError, match="disk gone"):
        failed.result(timeout=10)
    assert after.result(timeout=10) == "ok"
    executor.shutdown(wait=True)


def test_shutdown_runs_what_was_queued_then_refuses() -> None:
    executor = FreshThreadExecutor(max_workers=1, thread_name_prefix="slora-test")
    done: list[int] = []
    for i in range(3):
        executor.submit(lambda i=i: (time.sleep(0.01), done.append(i)))
    executor.shutdown(wait=True)
    assert done == [0, 1, 2]
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit(lambda: None)
    with pytest.raises(ValueError, match="at least 1"):
        FreshThreadExecutor(max_workers=0, thread_name_prefix="slora-test")


def test_a_task_whose_thread_cannot_start_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    executor = FreshThreadExecutor(max_workers=1, thread_name_prefix="slora-test")
    real_start = threading.Thread.start
    refused = [False]

    def start_once_refused(self: threading.Thread) -> None:
        if self.name.startswith("slora-test_") and not refused[0]:
            refused[0] = True
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start_once_refused)
    first, second = executor.submit(lambda: 1), executor.submit(lambda: 2)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        first.result(timeout=10)
    assert second.result(timeout=10) == 2
    executor.shutdown(wait=True)
