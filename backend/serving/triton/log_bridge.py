"""Route the package's `logging` records into Triton's log (pb_utils.Logger), so they show with the server's."""

from __future__ import annotations

import logging

import triton_python_backend_utils as pb_utils


class TritonLogHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = f"[{record.name}] {self.format(record)}"
            if record.levelno >= logging.ERROR:
                pb_utils.Logger.log_error(message)
            elif record.levelno >= logging.WARNING:
                pb_utils.Logger.log_warn(message)
            elif record.levelno >= logging.INFO:
                pb_utils.Logger.log_info(message)
            else:
                pb_utils.Logger.log_verbose(message)
        except Exception:  # a log line must never take a request down
            self.handleError(record)


def route_logging(level: int = logging.INFO) -> None:
    """Send records of the `slora` loggers to Triton's log (once per process)."""
    root = logging.getLogger("slora")
    if not any(isinstance(h, TritonLogHandler) for h in root.handlers):
        root.addHandler(TritonLogHandler())
    root.setLevel(level)
    root.propagate = False
