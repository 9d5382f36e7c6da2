"""The read-ahead window: bounded by count and bytes, the head always read, finished reads forgotten out of the
window, a failed read reported as an AdapterError."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from slora.backend.adapters.host_adapter import AdapterRef, HostAdapter
from slora.backend.adapters.read_ahead import ReadAhead
from slora.backend.errors import AdapterError


def _ref(name: str, nbytes: int = 100) -> AdapterRef:
    return AdapterRef(name, Path(name), 0, (1,) + (0,) * 6, 1, nbytes)


class Reads:
    """A host source whose reads finish when the test says."""

    def __init__(self) -> None:
        self.memory: dict[str, HostAdapter] = {}
        self.started: dict[str, Future[HostAdapter]] = {}

    def lookup(self, ref: AdapterRef) -> HostAdapter | None:
        return self.memory.get(ref.name)

    def fetch(self, ref: AdapterRef) -> Future[HostAdapter]:
        self.started[ref.name] = Future()
        return self.started[ref.name]

    def finish(self, name: str, error: Exception | None = None) -> HostAdapter:
        empty, image = torch.zeros(0, dtype=torch.int64), torch.zeros(1, 1, 1)
        adapter = HostAdapter(name, Path(name), (1,) + (0,) * 6, (1.0,) + (0.0,) * 6, image, empty, empty)
        if error is not None:
            self.started[name].set_exception(error)
        else:
            self.started[name].set_result(adapter)
        return adapter


def test_the_window_bounds_reads_by_count_and_bytes_but_not_the_head() -> None:
    reads = Reads()
    window = ReadAhead(reads, max_reads=2, max_bytes=250)
    assert window.host_copy(_ref("a")) is None and window.host_copy(_ref("b")) is None
    assert window.host_copy(_ref("c")) is None and "c" not in reads.started  # two reads at most
    assert window.host_copy(_ref("c"), force=True) is None and "c" in reads.started  # ... but the head goes
    window = ReadAhead(Reads(), max_reads=8, max_bytes=250)
    window.host_copy(_ref("a", 200))
    window.host_copy(_ref("b", 100))
    assert len(window) == 1  # 300 bytes would pass the bound
    assert window.pending() == 1


def test_a_finished_read_is_handed_out_then_forgotten() -> None:
    reads = Reads()
    window = ReadAhead(reads, max_reads=4, max_bytes=1000)
    ref = _ref("a")
    window.host_copy(ref)
    adapter = reads.finish("a")
    assert window.host_copy(ref) is adapter and window.pending() == 0
    window.keep_only({ref.key})
    assert len(window) == 1  # still among the next requests' adapters
    window.keep_only(set())
    assert len(window) == 0
    reads.memory["a"] = adapter
    assert window.host_copy(ref) is adapter and len(window) == 0  # in host memory: no read


def test_a_failed_read_raises_an_adapter_error_until_forgotten() -> None:
    reads = Reads()
    window = ReadAhead(reads, max_reads=4, max_bytes=1000)
    ref = _ref("a")
    window.host_copy(ref)
    reads.finish("a", OSError("input/output error"))
    for _ in range(2):
        with pytest.raises(AdapterError, match="input/output error"):
            window.host_copy(ref)
    window.forget(ref)
    assert window.host_copy(ref) is None and reads.started["a"].done() is False  # read again
