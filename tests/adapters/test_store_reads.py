"""The store's lazy side: refs without reads, reads on the store's threads, reads while the budget has room,
preload up to the budget, and refs of a name registered again."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from slora.backend.adapters.describe import describe_peft_adapter
from slora.backend.adapters.host_adapter import AdapterRef, HostAdapter, load_peft_adapter
from slora.backend.adapters.store import AdapterStore
from slora.backend.errors import AdapterError, AdapterNotFoundError
from slora.backend.memory.page_pool import PoolGeometry
from slora.backend.model.spec import ModelSpec
from tests.model_fixtures import ModelWithAdapters


class Disk:
    """A loader and describer over a fixture's adapters that count what they read, on which thread."""

    def __init__(self, model: ModelWithAdapters, fail: set[str] | None = None) -> None:
        self.spec = ModelSpec.from_dir(model.base)
        self.geometry = PoolGeometry(self.spec.num_layers, 8, self.spec.num_kv_heads, self.spec.head_dim)
        self.reads: list[tuple[str, str]] = []  # (name, thread name)
        self.described: list[str] = []
        self.fail = fail or set()
        self.gate = threading.Event()
        self.gate.set()

    def load(self, name: str, path: Path, generation: int) -> HostAdapter:
        self.gate.wait(timeout=30)
        self.reads.append((name, threading.current_thread().name))
        if name in self.fail:
            raise AdapterError(f"adapter {name!r}: disk on fire")
        return load_peft_adapter(name, path, self.spec, self.geometry, torch.float32, generation=generation)

    def describe(self, name: str, path: Path, generation: int) -> AdapterRef:
        self.described.append(name)
        return describe_peft_adapter(name, path, self.spec, self.geometry, torch.float32, generation=generation)

    def store(self, root: Path, budget: int = 1 << 30) -> AdapterStore:
        return AdapterStore(self.load, budget, root, describer=self.describe)

    def nbytes(self, model: ModelWithAdapters, name: str) -> int:
        return self.describe(name, model.adapter_root / name, 0).nbytes


def test_describe_reads_no_weights_and_remembers(llama: ModelWithAdapters) -> None:
    disk = Disk(llama)
    store = disk.store(llama.adapter_root)
    ref = store.describe("r3-all")
    assert store.describe("r3-all") is ref and disk.described == ["r3-all"] and disk.reads == []
    assert store.is_described("r3-all") and not store.in_host("r3-all")
    assert {i.name: i.ranks for i in store.list()}["r3-all"] == {m: 3 for m in ref.target_modules}
    with pytest.raises(AdapterNotFoundError):
        store.describe("missing")


def test_fetch_reads_on_a_reader_thread_once(llama: ModelWithAdapters) -> None:
    disk = Disk(llama)
    store = disk.store(llama.adapter_root)
    ref = store.describe("r5-ko")
    disk.gate.clear()
    futures = [store.fetch(ref) for _ in range(3)]
    assert all(f is futures[0] for f in futures) and not futures[0].done()
    disk.gate.set()
    adapter = futures[0].result(timeout=30)
    assert adapter.ref == ref and store.lookup(ref) is adapter and store.fetch(ref).result() is adapter
    assert len(disk.reads) == 1 and disk.reads[0][1].startswith("slora-read")


def test_a_failed_fetch_hands_over_its_error_and_is_not_remembered(llama: ModelWithAdapters) -> None:
    disk = Disk(llama, fail={"r1-qv"})
    store = disk.store(llama.adapter_root)
    ref = store.describe("r1-qv")
    with pytest.raises(AdapterError, match="disk on fire"):
        store.fetch(ref).result(timeout=30)
    with pytest.raises(AdapterError, match="disk on fire"):
        store.fetch(ref).result(timeout=30)
    assert [name for name, _ in disk.reads] == ["r1-qv", "r1-qv"] and store.lookup(ref) is None


def test_read_if_room_reads_only_what_fits_without_dropping_others(llama: ModelWithAdapters) -> None:
    disk = Disk(llama)
    budget = disk.nbytes(llama, "r3-all") + disk.nbytes(llama, "r1-qv")
    store = disk.store(llama.adapter_root, budget)
    assert store.read_if_room(store.describe("r3-all")) and store.read_if_room(store.describe("r1-qv"))
    assert not store.read_if_room(store.describe("r16-all"))
    assert store.in_host("r3-all") and store.in_host("r1-qv") and not store.in_host("r16-all")
    assert store.host_evictions == 0


def test_preload_stops_at_the_budget(llama: ModelWithAdapters) -> None:
    disk = Disk(llama)
    sizes = sorted(disk.nbytes(llama, name) for name in llama.adapters)
    store = disk.store(llama.adapter_root, sum(sizes) - sizes[0] // 2)
    loaded = store.preload(workers=1)
    assert 2 <= loaded < len(llama.adapters) and len(disk.reads) == loaded
    assert store.host_bytes <= store.budget_bytes and store.host_evictions == 0


def test_a_ref_keeps_the_adapter_it_was_described_as(llama: ModelWithAdapters, tmp_path: Path) -> None:
    """A request queued before its adapter's name was pointed elsewhere is served the adapter it was taken in
    with; the store keeps the new one."""
    disk = Disk(llama)
    store = disk.store(tmp_path)
    store.register("alias", llama.adapter_root / "r5-ko", load=False)
    old = store.describe("alias")
    store.register("alias", llama.adapter_root / "r1-qv", load=False, replace=True)
    new = store.describe("alias")
    assert new.generation > old.generation and new.ranks != old.ranks
    served = store.fetch(old).result(timeout=30)
    assert served.ref == old and store.lookup(old) is None and not store.in_host("alias")
    assert store.fetch(new).result(timeout=30).ref == new and store.in_host("alias")
    store.unregister("alias")
    assert store.fetch(new).result(timeout=30).ref == new  # from its path: a queued request still finishes


def test_reads_on_intake_says_when_taking_a_request_in_may_read_the_disk(llama: ModelWithAdapters) -> None:
    disk = Disk(llama)
    store = disk.store(llama.adapter_root, budget=disk.nbytes(llama, "r3-all"))
    assert store.reads_on_intake("r3-all")  # not described yet
    store.describe("r3-all")
    assert store.reads_on_intake("r3-all")  # the budget has room: intake reads it
    store.read_if_room(store.describe("r3-all"))
    assert not store.reads_on_intake("r3-all")  # in host memory
    store.describe("r16-all")
    assert not store.reads_on_intake("r16-all")  # no room: only described, the scheduler reads it later
