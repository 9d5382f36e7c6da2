"""Two real servers on loopback, each with its own adapter: what the endpoint picker would read from their metrics
ports with the configuration we ship, and where its LoRA-affinity scoring would send each adapter; and the preStop
hook, which lets the requests in flight finish before SIGTERM."""

from __future__ import annotations

import shutil
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.deploy import picker
from tests.deploy.conftest import REPO, load_script
from tests.serving.conftest import Launched, _stop, launch
from tests.serving.triton_calls import Collected, run_one, token_inputs

pytestmark = pytest.mark.server
wait_idle = load_script(REPO / "docker" / "wait_idle.py")

MAX_NUM_SEQS = 2  # max_lora: with two running, a third request waits
HOLDERS = {"alpha": "demo-qv-r4", "beta": "demo-o-r2"}  # adapter name → the demo adapter it copies
IDS = [1, 504, 3, 28, 1010, 30]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[dict[str, Launched]]:
    """One server per adapter: server "alpha" holds only the adapter alpha, "beta" only beta."""
    from slora.backend.adapters.demo import write_demo_adapters

    demo = tmp_path_factory.mktemp("demo-adapters")
    write_demo_adapters("default", demo)
    roots = {}
    for name, source in HOLDERS.items():
        roots[name] = tmp_path_factory.mktemp(f"server-{name}")
        shutil.copytree(demo / source, roots[name] / "adapters" / name)
    options = ("--lora-info-metric", "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", "512",
               "--pool-bytes", "192MiB")  # fmt: skip
    with ThreadPoolExecutor(len(roots)) as pool:
        started = {name: pool.submit(launch, root, "--adapter-dir", str(root / "adapters"), *options)
                   for name, root in roots.items()}  # fmt: skip
        launched = {name: future.result() for name, future in started.items()}
    try:
        yield launched
    finally:
        for server in launched.values():
            _stop(server.process, server.log)


def _long(server: Launched, adapter: str, tokens: int = 64) -> Collected:
    inputs = token_inputs(IDS, tokens, adapter, sampling={"temperature": 0, "ignore_eos": True})
    return run_one(server.grpc_url, "slora", inputs)


def _page(server: Launched) -> str:
    with urllib.request.urlopen(f"http://{server.metrics_url}/metrics", timeout=10) as response:
        return str(response.read().decode())


def _state_when(
    server: Launched, engine: dict[str, Any], done: Callable[[picker.EndpointState], bool], timeout_s: float = 60.0
) -> tuple[picker.EndpointState, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        page = _page(server)
        state = picker.extract(engine, page)
        if done(state):
            return state, page
        time.sleep(0.2)
    raise AssertionError(f"the endpoint state never matched; last: {state}")


def _gauge(page: str, name: str, **labels: str) -> float:
    sample = picker.latest(picker.Spec(name, labels), picker.families(page))
    assert sample is not None, (name, labels)
    return sample.value


def test_picker_reads_the_engine_state(servers: dict[str, Launched], epp_config: dict[str, Any]) -> None:
    """The shipped engine config's queue, running, KV and LoRA specs give what the engine reports."""
    engine = picker.engine_config(epp_config, "slora")
    server = servers["alpha"]
    with ThreadPoolExecutor(3) as pool:
        requests = [pool.submit(_long, server, "alpha", 48) for _ in range(3)]
        state, page = _state_when(server, engine, lambda s: s.running == MAX_NUM_SEQS and s.waiting == 1)
        assert state.active_models == {"alpha"} and state.waiting_models == {"alpha"}
        assert state.max_active_models == MAX_NUM_SEQS
        kv, adapter, free = (_gauge(page, "slora_pool_pages", kind=k) for k in ("kv", "adapter", "free"))
        assert 0 < state.kv_usage == pytest.approx(kv / (kv + adapter + free))
        assert [r.result().finish_reason for r in requests] == ["length"] * 3
    idle, page = _state_when(server, engine, lambda s: s.running == 0)
    assert (idle.waiting, idle.active_models, idle.waiting_models) == (0, set(), set())
    assert page.count("vllm:lora_requests_info{") >= 1  # a new label set's series comes before the old one goes
    assert _series_settle(server) == 1  # one series, however many adapter sets went by
    (series,) = picker.families(_page(server))["vllm:lora_requests_info"]
    assert series.labels == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "2"}


def _series_settle(server: Launched, timeout_s: float = 10.0) -> int:
    """How many LoRA info series the page shows once the old label sets are gone (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while (count := _page(server).count("vllm:lora_requests_info{")) != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    return count


def test_lora_affinity_sends_each_adapter_to_its_holder(
    servers: dict[str, Launched], epp_config: dict[str, Any]
) -> None:
    engine = picker.engine_config(epp_config, "slora")
    with ThreadPoolExecutor(len(servers)) as pool:
        requests = {name: pool.submit(_long, server, name) for name, server in servers.items()}
        states = {name: _state_when(server, engine, _runs(name))[0] for name, server in servers.items()}
        for adapter in HOLDERS:
            scores = {name: picker.lora_affinity(state, adapter) for name, state in states.items()}
            assert scores == {name: 1.0 if name == adapter else 0.8 for name in servers}, (adapter, states)
            assert picker.pick(states, adapter) == adapter
        assert all(r.result().finish_reason == "length" for r in requests.values())
    # Idle, the gauge names no adapter (as vLLM's does): every replica scores 0.8, and the other scorers decide.
    idle = {name: _state_when(server, engine, lambda s: not s.active_models)[0] for name, server in servers.items()}
    assert {picker.lora_affinity(state, "alpha") for state in idle.values()} == {0.8}


def _runs(adapter: str) -> Callable[[picker.EndpointState], bool]:
    return lambda state: adapter in state.active_models


def test_prestop_then_sigterm_ends_no_request(servers: dict[str, Launched]) -> None:
    """A rolling update's stop: the preStop hook returns once the request in flight has finished; SIGTERM then
    finds nothing to abort and slora-serve exits 0. (Last in this module: it stops server beta.)"""
    server = servers["beta"]
    url = f"http://{server.metrics_url}/metrics"
    with ThreadPoolExecutor(1) as pool:
        request: Future[Collected] = pool.submit(_long, server, "beta", 32)
        while not wait_idle.read_in_flight(url):
            time.sleep(0.02)
        assert wait_idle.wait_idle(url, grace_s=0.0, quiet_s=0.5, timeout_s=120.0, poll_s=0.1)
        assert request.done() and request.result().finish_reason == "length"
    assert not wait_idle.wait_idle(url, grace_s=0.0, quiet_s=5.0, timeout_s=0.5, poll_s=0.1)  # can time out
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(90) == 0
    assert wait_idle.read_in_flight(url) is None  # gone: a hook would return at once
