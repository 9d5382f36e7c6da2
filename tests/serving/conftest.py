"""One real Triton server for the whole session, started through `slora-serve` on free ports.

The server runs the default model (SmolLM2-135M-Instruct, float32 on CPU) with the demo adapters, a broken
adapter (for the load-error test), and a multi_lora.json registry naming one more adapter outside the root.
Small limits keep CI quick and make the overload test reach the waiting-queue bound.
`reference` is an in-process LLMEngine with the same configuration: served greedy outputs must equal it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 16
MAX_WAITING = 48
POOL_BYTES = "192MiB"
REGISTRY_ADAPTER = "registry-adapter"  # named by multi_lora.json, outside the adapter root
READY_TIMEOUT_S = 600.0
# Where the served engine runs: cpu, or cuda to serve a test's traffic on a GPU host (float32 there too, so that its
# tokens can be compared with a reference engine's; test_many_adapters puts its reference on the same device).
SERVE_DEVICE = os.environ.get("SLORA_TEST_SERVE_DEVICE", "cpu")


@dataclass(frozen=True)
class Server:
    http_url: str
    grpc_url: str
    metrics_url: str
    adapter_dir: Path
    spare_adapter: Path  # an adapter folder outside the root, for runtime registration
    log: Path
    process: subprocess.Popen

    @property
    def demo_adapters(self) -> list[str]:
        from slora.backend.adapters.demo import DEMO_ADAPTERS

        return [a.name for a in DEMO_ADAPTERS]


def _free_ports(count: int) -> list[int]:
    sockets = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _serve_command() -> list[str]:
    script = Path(sys.executable).parent / "slora-serve"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "slora.backend.launcher.cli"]


def _make_adapters(root: Path) -> tuple[Path, Path, Path]:
    """adapters/ (demo + broken), extra/ (registry adapter + spare), and the multi_lora.json naming the former."""
    from slora.backend.adapters.demo import write_demo_adapters

    adapters = root / "adapters"
    write_demo_adapters("default", adapters)
    broken = adapters / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    (broken / "adapter_model.safetensors").write_bytes(b"this is not a safetensors file")
    extra = root / "extra"
    extra.mkdir()
    shutil.copytree(adapters / "demo-qv-r4", extra / "for-registry")
    shutil.copytree(adapters / "demo-o-r2", extra / "spare")
    registry = root / "multi_lora.json"
    registry.write_text(json.dumps({REGISTRY_ADAPTER: "extra/for-registry"}))
    return adapters, extra / "spare", registry


def _wait_ready(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"slora-serve exited with {process.returncode}:\n{log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    process.kill()
    pytest.fail(f"the server was not ready after {READY_TIMEOUT_S} s:\n{log.read_text()[-6000:]}")


@dataclass(frozen=True)
class Launched:
    """A slora-serve process that is ready, and where it listens."""

    http_url: str
    grpc_url: str
    metrics_url: str
    workspace: Path
    log: Path
    process: subprocess.Popen


def launch(root: Path, *options: str) -> Launched:
    """Start slora-serve (the default model on SERVE_DEVICE, in float32, on free local ports) with `options`; wait
    until it is ready."""
    http, grpc, metrics = _free_ports(3)
    log = root / "server.log"
    workspace = root / "workspace"
    command = _serve_command() + [
        "--model", "default", "--device", SERVE_DEVICE, "--dtype", "float32", "--host", "127.0.0.1",
        "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
        "--workspace", str(workspace), *options,
    ]  # fmt: skip
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ})
    _wait_ready(f"127.0.0.1:{http}", process, log)
    return Launched(f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"127.0.0.1:{metrics}", workspace, log, process)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("server")
    adapters, spare, registry = _make_adapters(root)
    launched = launch(
        root, "--adapter-dir", str(adapters), "--lora-registry", str(registry), "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting", str(MAX_WAITING), "--pool-bytes", POOL_BYTES,
        "--lora-info-metric",
    )  # fmt: skip
    try:
        yield Server(launched.http_url, launched.grpc_url, launched.metrics_url, adapters, spare, launched.log,
                     launched.process)  # fmt: skip
    finally:
        _stop(launched.process, launched.log)


def _stop(process: subprocess.Popen, log: Path) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)  # as Ctrl-C
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            pytest.fail(f"slora-serve did not stop on SIGINT:\n{log.read_text()[-4000:]}")
    assert process.returncode == 0, f"slora-serve exited with {process.returncode}:\n{log.read_text()[-4000:]}"


@pytest.fixture(scope="session")
def reference(server: Server) -> Any:
    """An in-process engine configured like the served one (same model, adapters, context)."""
    from slora.backend.config import EngineConfig
    from slora.backend.engine.llm_engine import LLMEngine

    registry = server.adapter_dir.parent / "multi_lora.json"
    config = EngineConfig(
        model="default",
        device="cpu",
        adapter_root=str(server.adapter_dir),
        adapter_registry=str(registry),
        max_model_len=MAX_MODEL_LEN,
        pool_bytes=192 << 20,
    )
    return LLMEngine(config)
