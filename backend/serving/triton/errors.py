"""Triton status codes for the engine's errors, and the FINAL error response that ends a request."""

from __future__ import annotations

import logging
from typing import Any

import triton_python_backend_utils as pb_utils

from slora.backend.errors import AdapterExistsError, AdapterNotFoundError, EngineOverloadedError, SloraError

logger = logging.getLogger(__name__)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def error_code(exc: BaseException) -> Any:
    """UNAVAILABLE for overload (a full queue, an SLO refusal), NOT_FOUND for unknown adapters, ALREADY_EXISTS for
    a load of a name in use, INVALID_ARG for bad input, UNSUPPORTED for a refused admin command, else INTERNAL."""
    if isinstance(exc, EngineOverloadedError):
        return pb_utils.TritonError.UNAVAILABLE
    if isinstance(exc, AdapterNotFoundError):
        return pb_utils.TritonError.NOT_FOUND
    if isinstance(exc, AdapterExistsError):
        return pb_utils.TritonError.ALREADY_EXISTS
    if isinstance(exc, (SloraError, ValueError)):
        return pb_utils.TritonError.INVALID_ARG
    if isinstance(exc, PermissionError):
        return pb_utils.TritonError.UNSUPPORTED
    return pb_utils.TritonError.INTERNAL


def send_error(sender: Any, message: str, code: Any) -> None:
    """One error response flagged FINAL; a failure to send is logged, never raised."""
    try:
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)), flags=FINAL)
    except Exception:
        logger.exception("sending an error response failed")
