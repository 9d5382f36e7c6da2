"""The time Python's cyclic garbage collector stops the engine's process, by generation.

A collection runs on whichever thread's allocation triggers it and holds the GIL throughout, so every thread of the
process (the engine loop that launches the GPU's next step among them) waits for it. With thousands of adapters the
process keeps objects made while serving (each adapter loaded into the pool makes some; gc_freeze.py only leaves out
those built at start), and a full collection walks all of them: a pause the GPU may spend idle. These totals tell
whether it does (`slora_gc_seconds_total{generation}` on the metrics port, and the served benchmarks' steps table).
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

GENERATIONS = (0, 1, 2)  # CPython's: 2 is the full collection


class GcPauses:
    """Seconds and count of the collections of each generation since install(), from gc.callbacks."""

    def __init__(self) -> None:
        self.seconds = [0.0] * len(GENERATIONS)
        self.collections = [0] * len(GENERATIONS)
        self._began: float | None = None
        self._installed = False
        self._lock = threading.Lock()

    def install(self) -> None:
        """Start counting (once per process however often it is called)."""
        with self._lock:
            if not self._installed:
                gc.callbacks.append(self._on_collection)
                self._installed = True

    def uninstall(self) -> None:
        with self._lock:
            if self._installed:
                gc.callbacks.remove(self._on_collection)
                self._installed = False

    def as_stats(self) -> dict[str, float | int]:
        """The totals as EngineStats fields: gc_seconds_<generation>, gc_collections_<generation>."""
        out: dict[str, float | int] = {}
        for generation in GENERATIONS:
            out[f"gc_seconds_{generation}"] = self.seconds[generation]
            out[f"gc_collections_{generation}"] = self.collections[generation]
        return out

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        # Collections do not nest and run with the GIL held: a start is always followed by its own stop.
        if phase == "start":
            self._began = time.perf_counter()
            return
        if self._began is None:  # installed between a collection's start and its stop
            return
        generation = info["generation"]
        self.seconds[generation] += time.perf_counter() - self._began
        self.collections[generation] += 1
        self._began = None


def between(before: Any, after: Any) -> dict[str, dict[str, float]]:
    """The collections between two EngineStats (whose gc_seconds_<generation> and gc_collections_<generation> only
    grow), by generation ("0", "1", "2": full): {"seconds", "collections"}, as a served run records them
    (client/steps.py)."""
    return {
        str(g): {
            "seconds": getattr(after, f"gc_seconds_{g}") - getattr(before, f"gc_seconds_{g}"),
            "collections": getattr(after, f"gc_collections_{g}") - getattr(before, f"gc_collections_{g}"),
        }
        for g in GENERATIONS
    }


PROCESS = GcPauses()  # the one a process counts with (LLMEngine installs it)
