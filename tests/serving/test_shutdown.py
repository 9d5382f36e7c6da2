"""Ctrl-C with requests in flight: slora-serve stops Triton at once, with status 0, and leaves no process behind.

Left to itself, Triton 2.51 never finishes an ensemble request whose generation is still running when it stops:
it waits out its 30 s exit timeout and then hangs until it is killed. Each test starts a server of its own, since
it stops it.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient

from tests.serving.conftest import Launched, launch
from tests.serving.processes import live_processes
from tests.serving.triton_calls import text_inputs, token_inputs

pytestmark = pytest.mark.server

STOP_BOUND_S = 15.0  # well under Triton's 30 s exit timeout, which a stuck ensemble request waits out
PROMPT = "Write a very long story about a dragon."
LONG = {"temperature": 0, "ignore_eos": True, "max_tokens": 400}  # tens of seconds on CPU unless ended early
SERVER_OPTIONS = ("--max-model-len", "512", "--pool-bytes", "192MiB")


class Stream:
    """One request on a gRPC stream of its own (stream errors carry no request id)."""

    def __init__(self, url: str, model: str, inputs: list[grpcclient.InferInput]) -> None:
        self.items: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.client: grpcclient.InferenceServerClient | None = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=lambda result, error: self.items.put((result, error)))
        self.client.async_stream_infer(model, inputs, enable_empty_final_response=True)

    def wait_for_tokens(self, count: int = 2) -> None:
        for _ in range(count):
            _, error = self.items.get(timeout=120)
            assert error is None, error

    def wait_for_end(self) -> str:
        """The finish_reason of the request's FINAL response, or the error that ended it."""
        while True:
            result, error = self.items.get(timeout=STOP_BOUND_S)
            if error is not None:
                return f"error: {error.message()}"
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                reason = result.as_numpy("finish_reason")
                return reason.reshape(-1)[0].decode() if reason is not None and reason.size else ""

    def close(self, cancel: bool = False) -> None:
        if self.client is not None:
            self.client.stop_stream(cancel_requests=cancel)
            self.client.close()
            self.client = None


def _server_groups(server: Launched) -> set[int]:
    """The process groups of this server's tritonserver and stubs (its engine processes are in them too)."""
    repository = str(server.workspace / "model_repository")
    return {group for group, command in live_processes().values() if repository in command}


def _left_in(groups: set[int]) -> list[str]:
    return [f"{pid}: {command}" for pid, (group, command) in live_processes().items() if group in groups]


def _wait_for_exit(server: Launched, started: float) -> tuple[int, float]:
    """slora-serve's exit status and how long it took since `started`; a failure if it exceeds the bound."""
    try:
        code = server.process.wait(max(STOP_BOUND_S - (time.monotonic() - started), 0.1))
    except subprocess.TimeoutExpired:
        pytest.fail(f"slora-serve did not stop within {STOP_BOUND_S} s:\n{server.log.read_text()[-3000:]}")
    return code, time.monotonic() - started


def _kill(server: Launched, groups: set[int]) -> None:
    """After a failed test: nothing of this server may outlive it."""
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait()
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _remaining(groups: set[int]) -> list[str]:
    """What is left of the stopped server (a stub reaped by its parent may take a moment to leave /proc)."""
    deadline = time.monotonic() + 2.0
    while _left_in(groups) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _left_in(groups)


def _check_stopped(server: Launched, code: int, seconds: float, remaining: list[str]) -> None:
    log = server.log.read_text()
    assert code == 0, f"slora-serve exited with {code}:\n{log[-3000:]}"
    assert seconds < STOP_BOUND_S
    assert "exit timeout expired" not in log.lower()
    assert not remaining, f"processes of the stopped server remain: {remaining}"


def test_ctrl_c_ends_the_requests_in_flight_and_stops_cleanly(tmp_path: Path, tokenizer: Any) -> None:
    server = launch(tmp_path, *SERVER_OPTIONS)
    groups = _server_groups(server)
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    streams = [
        Stream(server.grpc_url, "ensemble", text_inputs(PROMPT, sampling=LONG)),
        Stream(server.grpc_url, "slora", token_inputs(ids, sampling=LONG)),
    ]
    try:
        for stream in streams:
            stream.wait_for_tokens()
        started = time.monotonic()
        server.process.send_signal(signal.SIGINT)  # as Ctrl-C
        endings = [stream.wait_for_end() for stream in streams]
        for stream in streams:
            stream.close()  # as clients do when their request has ended
        code, seconds = _wait_for_exit(server, started)
        remaining = _remaining(groups)
    finally:
        for stream in streams:
            stream.close()
        _kill(server, groups)
    assert endings == ["abort", "abort"]
    _check_stopped(server, code, seconds, remaining)


def test_client_gone_mid_stream_does_not_hold_up_the_stop(tmp_path: Path) -> None:
    server = launch(tmp_path, *SERVER_OPTIONS)
    groups = _server_groups(server)
    stream = Stream(server.grpc_url, "ensemble", text_inputs(PROMPT, sampling=LONG))
    try:
        stream.wait_for_tokens()
        stream.close(cancel=True)  # the client goes away while its request generates
        started = time.monotonic()
        server.process.send_signal(signal.SIGINT)
        code, seconds = _wait_for_exit(server, started)
        remaining = _remaining(groups)
    finally:
        _kill(server, groups)
    _check_stopped(server, code, seconds, remaining)


def test_an_idle_client_stream_does_not_hold_up_the_stop(tmp_path: Path, tokenizer: Any) -> None:
    """A client keeps its gRPC stream open after its request ended: Triton 2.51 unloads its models, then waits
    for that stream; slora-serve stops it soon after, cleanly, and no shared-memory region of its stubs is left."""
    server = launch(tmp_path, *SERVER_OPTIONS)
    groups = _server_groups(server)
    regions = [arg for _, command in live_processes().values() if str(server.workspace) in command
               for arg in command.split() if arg.startswith("triton_python_backend_shm_region_")]  # fmt: skip
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    stream = Stream(server.grpc_url, "slora", token_inputs(ids, sampling={"temperature": 0, "max_tokens": 4}))
    try:
        assert stream.wait_for_end() in ("length", "stop")  # the request is over; the stream stays open
        started = time.monotonic()
        server.process.send_signal(signal.SIGINT)
        code, seconds = _wait_for_exit(server, started)
        remaining = _remaining(groups)
    finally:
        stream.close()
        _kill(server, groups)
    _check_stopped(server, code, seconds, remaining)
    assert regions and not [r for r in regions if list(Path("/dev/shm").glob(f"{r}*"))]
