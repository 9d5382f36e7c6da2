"""One real server for the OpenAI API tests: slora-serve with --openai-port (the default model on CPU, free ports).

The adapter root holds the demo adapters; `spare` (a copy of demo-o-r2 outside the root) is for runtime loads.
Small limits (4 running, 2 waiting) let the overload test reach slora's waiting-queue bound with a few streams.
The adapter list is reused for 0.5 s and two server processes share the port (both passed through --openai-arg):
runtime changes show quickly, and the workers' path is the one tested.
`hf` gives greedy text of HF transformers (+ PEFT) for the same prompt ids: the independent reference.
"""

from __future__ import annotations

import shutil
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.serving.conftest import _free_ports, _stop, launch

MAX_NUM_SEQS = 4
MAX_WAITING = 2
BASE = "SmolLM2-135M-Instruct"  # the default model's folder name: its id in /v1/models
READY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class OpenAIServer:
    openai_url: str  # http://host:port/v1
    http_url: str  # Triton's HTTP host:port
    grpc_url: str
    metrics_url: str
    adapter_dir: Path
    spare_adapter: Path

    def client(self, **options: Any) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.openai_url, api_key="unused", **{"max_retries": 0, "timeout": 240.0, **options})


@pytest.fixture(scope="session")
def openai_server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[OpenAIServer]:
    from slora.backend.adapters.demo import write_demo_adapters

    root = tmp_path_factory.mktemp("openai-server")
    write_demo_adapters("default", root / "adapters")
    shutil.copytree(root / "adapters" / "demo-o-r2", root / "spare")
    (port,) = _free_ports(1)
    launched = launch(
        root, "--adapter-dir", str(root / "adapters"), "--max-model-len", "512", "--pool-bytes", "192MiB",
        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting", str(MAX_WAITING), "--openai-port", str(port),
        "--openai-arg=--models-ttl-s=0.5", "--openai-arg=--workers=2",
    )  # fmt: skip
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/health", launched.process, launched.log)
        yield OpenAIServer(f"http://127.0.0.1:{port}/v1", launched.http_url, launched.grpc_url, launched.metrics_url,
                           root / "adapters", root / "spare")  # fmt: skip
    finally:
        _stop(launched.process, launched.log)


def _wait_healthy(url: str, process: Any, log: Path) -> None:
    """slora-serve reports Triton ready a moment before the OpenAI API it starts next answers."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"slora-serve exited with {process.returncode}:\n{log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    pytest.fail(f"the OpenAI API was not healthy after {READY_TIMEOUT_S} s:\n{log.read_text()[-6000:]}")


class HFReference:
    """Greedy continuations by HF transformers (+ PEFT for an adapter), EOS included, with their top-2 margins."""

    def __init__(self, base: Path, adapter_dir: Path) -> None:
        self.base = base
        self.adapter_dir = adapter_dir
        self._models: dict[str | None, Any] = {}

    def greedy(self, prompt_ids: list[int], adapter: str | None, max_new_tokens: int) -> Any:
        from tests.factories import hf_reference
        from tests.reference import hf_greedy

        if adapter not in self._models:
            self._models[adapter] = hf_reference(self.base, self.adapter_dir / adapter if adapter else None)
        return hf_greedy(self._models[adapter], prompt_ids, max_new_tokens)


@pytest.fixture(scope="session")
def hf(openai_server: OpenAIServer, default_model_dir: Path) -> HFReference:
    return HFReference(default_model_dir, openai_server.adapter_dir)
