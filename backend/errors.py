"""Errors the engine raises at its public seams.

Every error names what is wrong (the file, the field, the adapter) so that a server can hand the message to the
client as is. Errors raised for one request never change the state of any other request.
"""

from __future__ import annotations


class SloraError(Exception):
    """Base class of the errors this package raises on purpose."""


class InvalidRequestError(SloraError, ValueError):
    """A request (prompt, sampling values, adapter name) is malformed; nothing was queued."""


class AdapterError(SloraError, ValueError):
    """An adapter directory cannot be used; the message names the adapter, the file and the reason."""


class AdapterNotFoundError(AdapterError, KeyError):
    """No adapter of that name is registered or present under the adapter root."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class AdapterExistsError(AdapterError):
    """`register` (admin `load` with a path) of a name that is already registered or a folder of the adapter root,
    without replace=True; nothing changed."""


class ModelLoadError(SloraError, ValueError):
    """A base-model checkpoint cannot be loaded; the message names the file and the reason."""


class EngineOverloadedError(SloraError):
    """The waiting queue is at its bound; the request was refused instead of queued."""


class CapacityError(InvalidRequestError):
    """The request can never fit in the page pool (prompt + max_tokens + adapter pages > pool)."""


class SloRefusedError(EngineOverloadedError):
    """A waiting request was refused because its first token could no longer come within its SLO
    (`ttft_slo_s`), or it waited longer than `queue_timeout_s`; servers answer UNAVAILABLE, as for a full queue.

    `reason` is the refusal's kind, as counted in EngineStats: "ttft_slo" (its deadline passed while it waited),
    "ttft_slo_early" (the measured rates said it would pass: refused before it did), "queue_timeout"."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # keeps `reason` across the engine-process pipe
        return type(self), (str(self), self.reason)
