"""Honest health and a protected admin path, on a server of its own (real Triton, CPU).

The tests run in order on one server: the admin token, then a hung engine (SIGSTOP) that the watchdog replaces,
then an engine killed past the restart limit, after which the server stays not ready.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from slora.client.admin import adapter_command
from slora.client.generate import ServerError
from tests.serving.conftest import Launched, _stop, launch
from tests.serving.processes import live_processes
from tests.serving.triton_calls import Collected, run_one, text_inputs, token_inputs

pytestmark = pytest.mark.server

TOKEN = "s3cret-token"
WATCHDOG_S = 4.0
IDS = [1, 504, 3, 28, 1010, 30]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[tuple[Launched, Path]]:
    from slora.backend.adapters.demo import write_demo_adapters

    root = tmp_path_factory.mktemp("health")
    adapters = root / "adapters"
    write_demo_adapters("default", adapters)
    spare = root / "spare"
    shutil.copytree(adapters / "demo-o-r2", spare)
    (root / "token").write_text(TOKEN + "\n")
    launched = launch(
        root, "--adapter-dir", str(adapters), "--admin-token-file", str(root / "token"), "--watchdog-timeout",
        str(WATCHDOG_S), "--max-engine-restarts", "1", "--max-model-len", "512", "--pool-bytes", "96MiB",
    )  # fmt: skip
    try:
        yield launched, spare
    finally:
        _stop(launched.process, launched.log)


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def _ready(server: Launched) -> tuple[int, int]:
    """(/v2/health/ready, /v2/models/slora/ready) status codes."""
    base = f"http://{server.http_url}"
    return _status(f"{base}/v2/health/ready"), _status(f"{base}/v2/models/slora/ready")


def _wait(condition: object, timeout: float, what: str, server: Launched) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if condition():  # type: ignore[operator]
            return time.monotonic() - started
        time.sleep(0.2)
    pytest.fail(f"{what} not within {timeout} s:\n{server.log.read_text()[-4000:]}")


def _engine_pid(server: Launched) -> int:
    """The engine process of this server: the multiprocessing child in the process group of its stubs."""
    repository = str(server.workspace / "model_repository")
    processes = live_processes()
    groups = {group for group, command in processes.values() if repository in command}
    pids = [pid for pid, (group, command) in processes.items() if group in groups and "spawn_main" in command]
    assert len(pids) == 1, f"expected one engine process, found {pids}"
    return pids[0]


def _tokens(server: Launched, adapter: str | None) -> list[int]:
    got = run_one(server.grpc_url, "slora", token_inputs(IDS, 6, adapter, sampling=GREEDY))
    assert got.error is None, got.error
    return got.token_ids


def test_admin_commands_need_the_token(guarded: tuple[Launched, Path]) -> None:
    server, spare = guarded
    for token in (None, "wrong"):
        with pytest.raises(ServerError, match="'list' needs the server's admin token"):
            adapter_command(server.http_url, "list", admin_token=token)
    rows = adapter_command(server.http_url, "list", admin_token=TOKEN)
    assert "demo-qv-r4" in {row["name"] for row in rows}
    (row,) = adapter_command(server.http_url, "load", "runtime-one", str(spare), admin_token=TOKEN)
    assert row["name"] == "runtime-one"
    with pytest.raises(ServerError, match="'runtime-one'.*replace"):
        adapter_command(server.http_url, "load", "runtime-one", str(spare), admin_token=TOKEN)
    with pytest.raises(ServerError, match="'demo-qv-r4'.*replace"):
        adapter_command(server.http_url, "load", "demo-qv-r4", str(spare), admin_token=TOKEN)
    (row,) = adapter_command(server.http_url, "load", "runtime-one", str(spare), admin_token=TOKEN, replace=True)
    assert row["path"] == str(spare)
    assert _tokens(server, "runtime-one") == _tokens(server, "demo-o-r2")  # the spare is a copy of it


def test_a_hung_engine_is_killed_and_the_model_loaded_again(guarded: tuple[Launched, Path]) -> None:
    server, _ = guarded
    before = _tokens(server, "runtime-one")
    hung = _engine_pid(server)
    result: list[Collected] = []
    long_request = threading.Thread(target=lambda: result.append(
        run_one(server.grpc_url, "slora", token_inputs(IDS, 400, None, sampling=GREEDY))))  # fmt: skip
    long_request.start()
    time.sleep(1.0)
    os.kill(hung, signal.SIGSTOP)
    long_request.join(WATCHDOG_S + 30)
    assert result and result[0].error is not None and "watchdog" in result[0].error, result
    _wait(lambda: _ready(server)[1] != 200, 30, "the model reporting not ready while it is loaded again", server)
    _wait(lambda: _ready(server) == (200, 200), 300, "the model ready again", server)
    assert _engine_pid(server) != hung
    assert _tokens(server, "runtime-one") == before  # its runtime registration came back with the new engine
    assert "restart 1 of 1" in server.log.read_text()
    # Triton loads the alias again once slora is back, which takes seconds after slora reports ready
    _wait(lambda: server.log.read_text().count("successfully loaded 'ensemble'") >= 2, 60, "the alias loaded again",
          server)  # fmt: skip
    alias = run_one(
        server.grpc_url, "ensemble", text_inputs("Hi", True, {"temperature": 0, "max_tokens": 3, "ignore_eos": True})
    )
    assert alias.error is None and alias.finish_reason == "length"  # the alias serves through the new engine


def test_an_engine_dead_past_the_restart_limit_is_not_ready(guarded: tuple[Launched, Path]) -> None:
    server, _ = guarded
    os.kill(_engine_pid(server), signal.SIGKILL)
    seconds = _wait(lambda: _ready(server) == (400, 400), 30, "the server and the model not ready", server)
    assert seconds < 15
    got = run_one(server.grpc_url, "slora", token_inputs(IDS, 4, None, sampling=GREEDY))
    assert got.error is not None
    reason = _wait_unavailable(server)
    assert "restarted 1 times already" in reason and "exited unexpectedly" in reason
    assert _ready(server) == (400, 400)  # and it stays so


def _wait_unavailable(server: Launched) -> str:
    """The reason Triton's repository index gives for slora once its last load has failed."""
    index: dict[str, dict[str, str]] = {}

    def failed() -> bool:
        request = urllib.request.Request(f"http://{server.http_url}/v2/repository/index", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            index.update({row["name"]: row for row in json.loads(response.read())})
        return index["slora"]["state"] == "UNAVAILABLE" and bool(index["slora"].get("reason"))

    _wait(failed, 60, "slora's failed load in the repository index", server)
    return index["slora"]["reason"]
