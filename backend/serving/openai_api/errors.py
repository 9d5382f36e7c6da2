"""Errors in OpenAI's format, with the HTTP status each kind of failure gets.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

    400 invalid_request_error   a bad field (named in `param` and the message), or input slora refused
    404 invalid_request_error   unknown model (code model_not_found, the message names it)
    429 rate_limit_error        slora's waiting queue is full, or the request could not meet its TTFT SLO
    503 server_error            the server is shutting down, the engine restarts, or Triton cannot be reached
    500 server_error            the engine failed while running the request

429 and 503 carry Retry-After. slora's own errors reach us as text only (Triton 2.51 sends no status code on gRPC
streams, docs/serving.md), so `from_triton` sorts them by the phrases of the messages slora writes
(backend/errors.py and where they are raised); anything else slora refuses is the request's fault: 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Phrases of slora's messages, by what they mean (the raising sites: adapters/store.py, engine/llm_engine.py,
# runtime/engine_loop.py, runtime/engine_process.py, engine/slo.py, serving/triton/responder.py).
_NOT_FOUND = ("is not registered",)
_INVALID_NAME = ("adapter name",)  # with "is invalid": no adapter can have that name
_OVERLOADED = ("try again later", "refused: its first token cannot come", "refused: queue_timeout_s")
_UNAVAILABLE = ("shutting down", "engine has stopped", "engine process exited", "could not be restarted",
                "is not ready", "unknown model")  # fmt: skip
_FAILED = "request failed:"


@dataclass
class OpenAIError(Exception):
    """One failed request: what the client reads, and the HTTP status and headers it gets."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def model_not_found(model: str, detail: str = "") -> OpenAIError:
    message = f"The model {model!r} does not exist" + (f": {detail}" if detail else "")
    return OpenAIError(404, message, param="model", code="model_not_found")


def unavailable(message: str, retry_after_s: int) -> OpenAIError:
    return OpenAIError(503, message, type="server_error", code="unavailable", retry_after_s=retry_after_s)


def from_triton(message: str, model: str, retry_after_s: int, reachable: bool = True) -> OpenAIError:
    """The OpenAI error for slora's (or Triton's) error `message` on a request for `model`."""
    lowered = message.lower()
    if not reachable or any(phrase in lowered for phrase in _UNAVAILABLE):
        return unavailable(message, retry_after_s)
    if any(phrase in lowered for phrase in _OVERLOADED):
        return OpenAIError(429, message, type="rate_limit_error", code="overloaded", retry_after_s=retry_after_s)
    if any(phrase in lowered for phrase in _NOT_FOUND) or (
        any(phrase in lowered for phrase in _INVALID_NAME) and "is invalid" in lowered
    ):
        return model_not_found(model, message)
    if lowered.startswith(_FAILED):
        return OpenAIError(500, message, type="server_error", code="internal_error")
    return bad_request(message)
