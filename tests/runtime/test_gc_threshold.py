"""young_threshold_raised: a step's worth of short-lived tracked objects no longer triggers a young collection, cyclic
garbage is still collected, and the thresholds before come back."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from slora.backend.runtime.gc_pauses import GcPauses
from slora.backend.runtime.gc_threshold import YOUNG_THRESHOLD, raise_young_threshold, young_threshold_raised


@pytest.fixture
def pauses() -> Iterator[GcPauses]:
    counted = GcPauses()
    counted.install()
    yield counted
    counted.uninstall()


@pytest.fixture(autouse=True)
def python_defaults() -> Iterator[None]:
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*before)


def _steps(count: int, live: int) -> None:
    """`count` steps, each holding `live` tracked objects until it ends (as an engine step holds its batch)."""
    for _ in range(count):
        held = [[i] for i in range(live)]
        del held


def _young(pauses: GcPauses) -> int:
    return int(pauses.as_stats()["gc_collections_0"])


def test_steps_of_thousands_of_objects_collect_at_python_defaults_but_not_raised(pauses: GcPauses) -> None:
    before = _young(pauses)
    _steps(50, 2000)
    assert _young(pauses) - before >= 50, "at 700 each step of 2000 live objects triggers young collections"
    with young_threshold_raised():
        before = _young(pauses)
        _steps(50, 2000)
        assert _young(pauses) == before


def test_cyclic_garbage_is_still_collected_automatically() -> None:
    class Node:
        pass

    with young_threshold_raised():
        node = Node()
        node.self = node  # type: ignore[attr-defined]
        alive = weakref.ref(node)
        del node
        for _ in range(3 * YOUNG_THRESHOLD):  # allocations that outlive the loop, so the young count grows
            _keep.append([])
        assert alive() is None
    _keep.clear()


_keep: list[list[int]] = []


def test_thresholds_come_back_and_a_higher_or_disabled_one_is_kept() -> None:
    with young_threshold_raised():
        assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)
    gc.set_threshold(5 * YOUNG_THRESHOLD, 10, 10)
    assert raise_young_threshold() == (5 * YOUNG_THRESHOLD, 10, 10)
    assert gc.get_threshold() == (5 * YOUNG_THRESHOLD, 10, 10)
    gc.set_threshold(0, 10, 10)  # automatic collection off: the host's choice
    raise_young_threshold()
    assert gc.get_threshold() == (0, 10, 10)
