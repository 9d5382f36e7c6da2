"""How slora-serve runs the OpenAI server: a process of its own, started once Triton is ready, stopped first.

    slora-serve --openai-port 9000 ...   →   python -m slora.backend.serving.openai_api.server
                                              --triton-url 127.0.0.1:<grpc-port> --port 9000 --model ... [--openai-arg]

Start: the process is started with this interpreter, in a session of its own (a terminal's Ctrl-C reaches only
slora-serve, which stops everything in order) and with SIGTERM as its parent-death signal; slora-serve waits until
its /health answers 200. Stop: SIGTERM (uvicorn ends open streams within their grace period, and each one cut aborts
its request in slora), then SIGKILL if it is still there; Triton is drained after that. Standard library only: the
launcher needs no web stack unless the API is asked for.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from slora.backend.launcher.processes import answers_ok, child_setup

logger = logging.getLogger("slora.serve")

NEEDED = ("fastapi", "uvicorn")
READY_TIMEOUT_S = 300.0  # loading transformers and the tokenizer takes seconds; a cold machine, more
STOP_TIMEOUT_S = 15.0  # after SIGTERM: the streams' grace period (5 s) and uvicorn's own exit


@dataclass(frozen=True)
class OpenAILaunch:
    port: int
    host: str  # where Triton's endpoints listen; the OpenAI API listens there too
    grpc_port: int
    model: str
    tokenizer: str | None = None
    admin_token_file: str | None = None
    extra_args: tuple[str, ...] = ()  # more options of server.py (--served-model-name, --lora-separator, ...)

    @property
    def local_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    def command(self) -> list[str]:
        command = [sys.executable, "-m", "slora.backend.serving.openai_api.server",
                   "--triton-url", f"{self.local_host}:{self.grpc_port}", "--host", self.host,
                   "--port", str(self.port), "--model", self.model]  # fmt: skip
        if self.tokenizer:
            command += ["--tokenizer", self.tokenizer]
        if self.admin_token_file:
            command += ["--admin-token-file", self.admin_token_file]
        return command + list(self.extra_args)


def check_openai_port(port: int, others: dict[str, int]) -> None:
    """Refuse a bad --openai-port, or one the API cannot be served on, before anything starts."""
    if not 1 <= port <= 65535:
        raise ValueError(f"openai_port must be in 1..65535, got {port}")
    if port in others.values():
        raise ValueError(f"openai_port {port} is taken by another endpoint: {others}")
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"--openai-port needs {', '.join(missing)}: pip install 'slora-triton[openai]'")


class OpenAIFrontend:
    """The running OpenAI server process."""

    def __init__(self, launch: OpenAILaunch, process: subprocess.Popen) -> None:
        self.launch = launch
        self.process = process

    @classmethod
    def start(cls, launch: OpenAILaunch, stop: threading.Event) -> OpenAIFrontend:
        """Start it and wait until it is ready; raises RuntimeError if it exits first or never gets ready."""
        logger.info("starting the OpenAI API: %s", " ".join(launch.command()))
        process = subprocess.Popen(launch.command(), env={**os.environ}, preexec_fn=child_setup)
        frontend = cls(launch, process)
        try:
            frontend._wait_ready(stop)
        except BaseException:
            frontend.stop()
            raise
        logger.info("OpenAI API: http://%s:%d/v1", launch.local_host, launch.port)
        return frontend

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if not self.alive():
            return
        logger.info("stopping the OpenAI API")
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("the OpenAI API did not stop within %.0f s: killing it", STOP_TIMEOUT_S)
            self.process.kill()
            self.process.wait()

    def _wait_ready(self, stop: threading.Event) -> None:
        url = f"http://{self.launch.local_host}:{self.launch.port}/health"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not stop.is_set():
            if not self.alive():
                raise RuntimeError(f"the OpenAI API exited with status {self.process.returncode} before it was ready")
            if answers_ok(url):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI API was not ready after {READY_TIMEOUT_S:.0f} s")
            stop.wait(0.25)
