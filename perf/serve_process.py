"""`slora-serve` as a benchmark's child process: started on free local ports, waited for, stopped as Ctrl-C would.

    with ServeProcess(["--model", "default", "--device", "cpu"], log=Path("server.log")) as server:
        ...  # server.grpc_url, server.http_url, server.metrics_url

Its output goes to `log`; a server that exits or is not ready within `ready_timeout_s` raises RuntimeError with
the log's tail; `env` adds to this process's environment. Stopping sends SIGINT (slora-serve then ends the
requests in flight and stops tritonserver with every process of it), and kills it only if it has not exited after
`stop_timeout_s`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"


def serve_command() -> list[str]:
    """slora-serve of this interpreter's environment (its script, else the module)."""
    script = Path(sys.executable).parent / "slora-serve"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "slora.backend.launcher.cli"]


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind((HOST, 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


class ServeProcess:
    """One slora-serve process with `args` (model, adapters, engine options; not the ports or host)."""

    def __init__(
        self,
        args: list[str],
        log: Path,
        ready_timeout_s: float = 900.0,
        stop_timeout_s: float = 90.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.args = list(args)
        self.env = {**os.environ, **(env or {})}
        self.log = log
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        http, grpc, metrics = free_ports(3)
        self.http_url, self.grpc_url, self.metrics_url = f"{HOST}:{http}", f"{HOST}:{grpc}", f"{HOST}:{metrics}"
        self._ports = ["--host", HOST, "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port",
                       str(metrics), "--ready-timeout", str(ready_timeout_s)]  # fmt: skip
        self.process: subprocess.Popen | None = None

    def start(self) -> ServeProcess:
        """Start it and wait until it is ready."""
        command = serve_command() + self.args + self._ports
        self.log.parent.mkdir(parents=True, exist_ok=True)
        logger.info("starting slora-serve %s (log: %s)", " ".join(self.args), self.log)
        started = time.monotonic()
        with self.log.open("w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        logger.info("slora-serve ready at %s after %.1fs", self.grpc_url, time.monotonic() - started)
        return self

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"slora-serve exited with {self.process.returncode}:\n{self.log_tail()}")
            if _ready(self.http_url):
                return
            time.sleep(0.5)
        raise RuntimeError(f"slora-serve was not ready after {self.ready_timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGINT, as Ctrl-C; killed if still running after stop_timeout_s."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("slora-serve did not stop within %.0fs; killing it", self.stop_timeout_s)
            process.kill()
            process.wait()

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.is_file() else ""

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _ready(http_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
