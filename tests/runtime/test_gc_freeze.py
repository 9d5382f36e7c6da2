"""freeze_startup_objects: what is alive at start leaves the collector's generations; later garbage still goes."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from slora.backend.runtime.gc_freeze import freeze_startup_objects, startup_objects_frozen


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()  # give the test process its collector back


def test_objects_alive_at_start_are_frozen_and_later_cycles_still_collected(unfrozen: None) -> None:
    kept = Node()
    freeze_startup_objects()
    assert gc.get_freeze_count() > 0
    assert not any(o is kept for o in gc.get_objects()), "a startup object is still in the collector's generations"
    later = weakref.ref(Node())  # garbage made after start, in a cycle
    gc.collect()
    assert later() is None


def test_a_benchmark_block_unfreezes_after() -> None:
    with startup_objects_frozen():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
