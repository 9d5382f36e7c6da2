"""An engine service with one callback per request, the way these tests submit: `RequestCallbacks` is its sink."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from slora.backend.runtime.messages import Submission
from slora.backend.runtime.output_sink import OutputCallback, RequestCallbacks, RequestSink


class CallbackEngine:
    """`start(sink)` builds the service (LocalEngine or EngineProcess); everything but `submit` is the service's."""

    def __init__(self, start: Callable[[RequestSink], Any]) -> None:
        self.sink = RequestCallbacks()
        self.service = start(self.sink)

    def submit(self, job: Submission, callback: OutputCallback) -> None:
        self.sink.add(job.request_id, callback)
        self.service.submit(job)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.service, name)
