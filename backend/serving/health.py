"""The served engine's health, written where slora-serve reads it (launcher/supervisor.py), and into the metrics.

Triton 2.51 decides a model's readiness from its load state alone: a model whose engine has died, or hangs, still
answers READY. So every HEALTH_S the `slora` model writes its engine's health (EngineService.health) to a file of
slora-serve's workspace, atomically:

    {"state": "serving" | "restarting" | "failed" | "stopped", "reason": "...", "pid": <stub pid>, "at": <unix s>}

and slora-serve, which runs Triton with explicit model control, unloads and loads the model again when the state
is "failed" or the file stops changing (the model's process hangs): while it loads, and if it cannot, the model
and the server report not ready. Plain files and threads: no Triton here.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from slora.backend.runtime.engine_service import EngineHealth

logger = logging.getLogger(__name__)

HEALTH_S = 0.5


class HealthReporter:
    """Writes `health()` to `path` every HEALTH_S, and tells `on_change` when serving starts or stops."""

    def __init__(
        self, health: Callable[[], EngineHealth], path: Path | None, on_change: Callable[[bool], None]
    ) -> None:
        self._health = health
        self._path = path
        self._on_change = on_change
        self._serving: bool | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slora-health", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop reporting; the last word in the file is "stopped" (the model is being unloaded on purpose)."""
        self._stop.set()
        self._thread.join(5.0)
        self._write(EngineHealth("stopped", "the model is stopping"))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._report(self._health())
            except Exception:
                logger.exception("reporting the engine's health failed")
            self._stop.wait(HEALTH_S)

    def _report(self, health: EngineHealth) -> None:
        if health.serving != self._serving:
            if self._serving is not None or not health.serving:
                logger.log(logging.INFO if health.serving else logging.ERROR, "engine health: %s%s", health.state,
                           f" ({health.reason})" if health.reason else "")  # fmt: skip
            self._serving = health.serving
            self._on_change(health.serving)
        self._write(health)

    def _write(self, health: EngineHealth) -> None:
        if self._path is None:
            return
        record = {"state": health.state, "reason": health.reason, "pid": os.getpid(), "at": time.time()}
        staged = self._path.with_name(f".{self._path.name}.tmp")
        staged.write_text(json.dumps(record))
        os.replace(staged, self._path)


def read_health(path: Path) -> dict[str, object] | None:
    """The last health record in `path`, or None when there is none (yet) or it cannot be read."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None
