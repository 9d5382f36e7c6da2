"""A model that fails to load ends slora-serve at once, with the reason, instead of a wait for readiness.

Triton finishes starting only when every model has loaded or failed, and the ensemble alias waits for slora's
engine: the failed slora model leaves a note beside its engine's socket (runtime/peers.py:note_load_failure), which
ends the alias's wait and slora-serve's.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.serving.conftest import _free_ports, _serve_command
from tests.serving.processes import live_processes

# The engine of the default model on CPU fails in seconds; the launcher's own ready timeout is 900 s.
FAIL_BOUND_S = 120.0


pytestmark = pytest.mark.server


def test_a_model_that_fails_to_load_ends_the_launcher_with_its_reason(tmp_path: Path) -> None:
    """page_size=1 passes the option checks but not the engine's start (a page narrower than SmolLM2's rows)."""
    http, grpc, metrics = _free_ports(3)
    workspace = tmp_path / "workspace"
    command = _serve_command() + [
        "--model", "default", "--device", "cpu", "--host", "127.0.0.1", "--http-port", str(http),
        "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--workspace", str(workspace), "--page-size", "1",
    ]  # fmt: skip
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=FAIL_BOUND_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"slora-serve still waited after {FAIL_BOUND_S} s:\n{(exc.stderr or b'').decode()[-3000:]}")
    log = done.stdout + done.stderr
    assert done.returncode == 1, log[-3000:]
    assert "model 'slora' failed to load" in log, log[-3000:]
    assert "page_size=1" in log, log[-3000:]
    assert time.monotonic() - started < FAIL_BOUND_S
    left = [command for _, command in live_processes().values() if str(workspace) in command]
    assert not left, f"processes of the failed server remain: {left}"
