"""The tenant replay's clients: which tenant each client process sends, one stream a tenant, one clock for all
processes, and their results merged (bench_tenants_served's server tests run the processes against Triton)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from perf import bench_tenants_served as served
from perf.bench_serving import ReplayResult, ServingOptions, StreamReplay
from perf.metrics import RequestRecord
from perf.tenant_clients import ClientWorkers, ReplayJob, assign_clients, tenant_of_request
from perf.triton_protocol import ModelIO, Target
from perf.workload import TraceRequest
from tests.perf.test_bench_serving import FakeClient


def _requests(counts: dict[str, int]) -> list[TraceRequest]:
    """Requests of each tenant (its adapter) in `counts`, interleaved in arrival order."""
    names = [name for name, n in counts.items() for _ in range(n)]
    order = sorted(range(len(names)), key=lambda i: (i % 7, i))  # tenants mixed in time
    return [TraceRequest(k, 0.001 * k, names[i], (5, 6), 2) for k, i in enumerate(order)]


def _tenants(part: list[TraceRequest]) -> set[str]:
    return {tenant_of_request(r) for r in part}


LIGHT = {f"s1-{i:04d}": 5 + i % 3 for i in range(6)}


def test_heavy_tenants_get_a_client_and_light_ones_keep_theirs() -> None:
    without = assign_clients(_requests(LIGHT), 3)
    with_ = assign_clients(_requests({**LIGHT, "s1-0020": 60}), 3)
    assert [_tenants(p) for p in with_[1:]] == [_tenants(p) for p in without]  # the same light clients in both
    assert _tenants(with_[0]) == {"s1-0020"} and len(with_) == 3 and len(without) == 2
    assert [len(_tenants(p)) for p in without] == [3, 3]  # round robin
    for parts, n in ((without, sum(LIGHT.values())), (with_, sum(LIGHT.values()) + 60)):
        indices = [r.index for p in parts for r in p]
        assert sorted(indices) == list(range(n))  # each request once
        assert all([r.arrival for r in p] == sorted(r.arrival for r in p) for p in parts)


def test_one_client_sends_everything_and_none_is_refused() -> None:
    requests = _requests({**LIGHT, "s1-0020": 60})
    assert assign_clients(requests, 1) == [requests]
    assert assign_clients([], 3) == []
    with pytest.raises(ValueError, match="clients must be >= 1"):
        assign_clients(requests, 0)


class _StreamsSeen(FakeClient):
    """The fake server, noting which stream each request came on and when."""

    def __init__(self) -> None:
        super().__init__(ModelIO())
        self.streams: dict[str, int] = {}
        self.sent_at: list[float] = []
        self._opened = 0

    def stream_infer(self, iterator: Any) -> Any:
        stream = self._opened
        self._opened += 1

        async def tagged() -> Any:
            async for request in iterator:
                self.streams[request["request_id"]] = stream
                self.sent_at.append(time.perf_counter())
                yield request

        return super().stream_infer(tagged())


def test_each_tenant_has_a_stream_of_its_own() -> None:
    requests = _requests(LIGHT)
    client = _StreamsSeen()
    job = ReplayJob(served.TenantReplay, "fake", served.TARGET, ModelIO(), ServingOptions(), stream_a_tenant=True)
    replay = served.TenantReplay(client, served.TARGET, ModelIO(), requests, job.options_for(requests, None), None,
                                 len)  # fmt: skip
    asyncio.run(replay.run())
    assert all(record.ok for record in replay.records.values())
    stream_of: dict[str, set[int]] = {}
    for r in requests:
        stream_of.setdefault(tenant_of_request(r), set()).add(client.streams[f"r{r.index}"])
    assert all(len(streams) == 1 for streams in stream_of.values())  # a tenant's requests share one stream
    assert len(set().union(*stream_of.values())) == len(LIGHT)  # and no two tenants share one


def test_a_replay_waits_for_the_clock_it_is_given() -> None:
    """Processes started at different moments replay on one clock: the first request goes out at start_at plus its
    arrival, and the records' times count from start_at."""
    requests = [TraceRequest(0, 0.05, "s1-0000", (5, 6), 2), TraceRequest(1, 0.10, "s1-0001", (5,), 2)]
    client = _StreamsSeen()
    start_at = time.perf_counter() + 0.3
    replay = StreamReplay(client, Target.named("slora"), ModelIO(), requests, ServingOptions(start_at=start_at),
                          None, len)  # fmt: skip
    duration = asyncio.run(replay.run())
    assert client.sent_at[0] >= start_at + 0.05 and client.sent_at[1] >= start_at + 0.10
    first = replay.records["r0"]
    assert 0 < first.ttft < 0.25 and duration == pytest.approx(time.perf_counter() - start_at, abs=0.25)


def _record(index: int, tenant: str, done: bool) -> RequestRecord:
    record = RequestRecord(index, tenant, 4, 2, 0.1 * index)
    if done:
        record.add_chunk(0.1 * index + 0.05, 2)
        record.finish(0.1 * index + 0.06, "length")
    return record


def test_the_clients_results_merge() -> None:
    a = ReplayResult({"r0": _record(0, "a", True)}, set(), [], {"ttft_slo": 1, "queue_timeout": 0}, 0, 2.0, 0.3)
    b = ReplayResult({"r1": _record(1, "b", False), "r2": _record(2, "b", True)}, {"r1"}, ["boom"],
                     {"ttft_slo": 2, "queue_timeout": 1}, 1, 3.5, 0.2)  # fmt: skip
    merged = ReplayResult.merged([a, b])
    assert set(merged.records) == {"r0", "r1", "r2"} and merged.open == {"r1"} and merged.stream_errors == ["boom"]
    assert merged.refusals == {"ttft_slo": 3, "queue_timeout": 1} and merged.settled == 1
    assert merged.duration == 3.5 and merged.cpu_share == 0.3  # the last finish; the busiest client


def test_a_client_process_that_fails_says_why() -> None:
    """Both processes fail (no server answers); each one's result is read, so none is left for the next run."""
    workers = ClientWorkers(2)
    try:
        job = ReplayJob(served.TenantReplay, "localhost:9", served.TARGET, ModelIO(), ServingOptions(),
                        ready_timeout_s=0.5)  # fmt: skip
        parts = [_requests({"s1-0000": 2}), _requests({"s1-0001": 2})]
        for _ in range(2):
            with pytest.raises(RuntimeError, match="tenant client process failed.*not ready"):
                workers.replay(job, parts)
        with pytest.raises(ValueError, match="3 parts for 2 client processes"):
            workers.replay(job, [[], [], []])
    finally:
        workers.close()
