"""The supervisor: slora-serve keeps the `slora` model's readiness true to its engine, through Triton's model control.

Triton 2.51 reports a loaded model READY whatever happens inside its Python stub. slora-serve therefore runs
Triton with explicit model control and watches the health file that the model writes (serving/health.py):

    state "failed" (its engine died, or hung and was killed by the watchdog), or no new record for stale_s (the
    model's process hangs)
        → unload the ensemble alias and slora: /v2/models/slora/ready and /v2/health/ready answer 400
        → load it again, counting the restart (its registrations come back from the workspace's journal), then
          the alias: ready again once its engine serves
    more than max_restarts restarts in the server's life
        → load it with `failed_reason` set: the load fails with that reason, and the model and the server stay
          not ready (the reason shows in /v2/repository/index) until slora-serve is restarted

Requests sent meanwhile get Triton's own "model not ready" errors. The supervisor stops before slora-serve drains.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from slora.backend.launcher.model_repository import render_model
from slora.backend.serving.health import HEALTH_S, read_health

logger = logging.getLogger("slora.serve")

MODEL = "slora"
DEPENDENTS = ("ensemble",)  # peers of slora's engine: unloaded with it (their readiness follows it), loaded after it
LOAD_TIMEOUT_S = 3600.0  # a large model's load; the call returns as soon as Triton has an answer


@dataclass(frozen=True)
class SupervisorSettings:
    http_url: str  # host:port of Triton's HTTP endpoint
    repository: Path  # the rendered model repository
    parameters: dict[str, str]  # slora's config.pbtxt parameters as first rendered
    health_file: Path
    max_restarts: int = 3
    stale_s: float = 90.0  # no health record for this long: the model's process hangs


class Supervisor:
    def __init__(self, settings: SupervisorSettings) -> None:
        self.settings = settings
        self.restarts = 0
        self.failed: str | None = None  # why the model will not serve again
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slora-supervisor", daemon=True)

    @classmethod
    def start(cls, settings: SupervisorSettings) -> Supervisor:
        supervisor = cls(settings)
        supervisor._thread.start()
        return supervisor

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10.0)

    def check(self) -> str | None:
        """What is wrong with the model now, or None while it serves (or has not reported yet, for a while)."""
        record = read_health(self.settings.health_file)
        if record is None:
            return None
        age = time.time() - float(str(record.get("at", 0)))
        if record.get("state") == "failed":
            return str(record.get("reason") or "its engine failed")
        if record.get("state") != "stopped" and age > self.settings.stale_s:
            return f"the slora model has not reported its health for {age:.0f} s (its process hangs)"
        return None

    def _run(self) -> None:
        while not self._stop.wait(HEALTH_S) and self.failed is None:
            problem = self.check()
            if problem is not None:
                self.reload(problem)

    def reload(self, problem: str) -> None:
        """Unload the model and load it again, or for good with `failed_reason` past max_restarts."""
        self.restarts += 1
        values = {**self.settings.parameters, "engine_restarts": str(self.restarts)}
        if self.restarts > self.settings.max_restarts:
            self.failed = f"{problem}; it was restarted {self.settings.max_restarts} times already"
            values["failed_reason"] = self.failed
            logger.error("slora model: %s; it stays not ready until slora-serve is restarted", self.failed)
        else:
            logger.error("slora model: %s; loading it again (restart %d of %d)", problem, self.restarts,
                         self.settings.max_restarts)  # fmt: skip
        render_model(self.settings.repository, MODEL, values)
        self.settings.health_file.unlink(missing_ok=True)
        for dependent in DEPENDENTS:
            self._repository_call(f"models/{dependent}/unload")
        self._repository_call(f"models/{MODEL}/unload")
        if self._repository_call(f"models/{MODEL}/load") and self.failed is None:
            for dependent in DEPENDENTS:
                self._repository_call(f"models/{dependent}/load")
            logger.info("slora model: loaded again (restart %d)", self.restarts)

    def _repository_call(self, path: str) -> bool:
        """POST Triton's model-repository API; False (logged) when it refuses."""
        request = urllib.request.Request(f"http://{self.settings.http_url}/v2/repository/{path}", data=b"{}",
                                         method="POST", headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=LOAD_TIMEOUT_S):
                return True
        except urllib.error.HTTPError as exc:
            message = _error_text(exc)
            level = logging.INFO if self.failed is not None and path.endswith("/load") else logging.ERROR
            logger.log(level, "Triton refused %s: %s", path, message)
        except (urllib.error.URLError, OSError) as exc:
            logger.error("Triton did not answer %s: %s", path, exc)
        return False


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read()).get("error", exc.reason))[:500]
    except ValueError:
        return f"HTTP {exc.code}"
