"""GcPauses counts each collection under its generation, with the time it took, from gc.callbacks."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from slora.backend.runtime.gc_pauses import GENERATIONS, GcPauses


@pytest.fixture
def pauses() -> Iterator[GcPauses]:
    counted = GcPauses()
    counted.install()
    counted.install()  # a second install must not count each collection twice
    yield counted
    counted.uninstall()


def _garbage_cycles(n: int) -> None:
    """`n` reference cycles that only the cyclic collector frees."""
    for _ in range(n):
        a: list[object] = []
        a.append(a)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_a_collection_is_counted_under_its_generation(pauses: GcPauses, generation: int) -> None:
    gc.disable()  # no automatic collection between the counts read and the one forced
    try:
        before = pauses.as_stats()
        _garbage_cycles(1000)
        gc.collect(generation)
        after = pauses.as_stats()
    finally:
        gc.enable()
    assert after[f"gc_collections_{generation}"] == before[f"gc_collections_{generation}"] + 1
    assert after[f"gc_seconds_{generation}"] > before[f"gc_seconds_{generation}"]
    for other in GENERATIONS:
        if other != generation:
            assert after[f"gc_collections_{other}"] == before[f"gc_collections_{other}"]
            assert after[f"gc_seconds_{other}"] == before[f"gc_seconds_{other}"]


def test_collections_after_uninstall_are_not_counted() -> None:
    counted = GcPauses()
    counted.install()
    gc.collect()
    counted.uninstall()
    seen = counted.as_stats()
    assert seen["gc_collections_2"] == 1
    gc.collect()
    assert counted.as_stats() == seen


def test_automatic_collections_are_counted(pauses: GcPauses) -> None:
    """Allocations past the young generation's threshold trigger collections the callback sees."""
    before = pauses.as_stats()["gc_collections_0"]
    _garbage_cycles(20 * gc.get_threshold()[0])
    assert pauses.as_stats()["gc_collections_0"] > before
