"""Tenant isolation through the real server: a light tenant ahead of a flood, SLO refusals, bad values named."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from slora.client.admin import set_tenant_weights
from slora.client.generate import ServerError
from tests.serving.conftest import Launched, _stop, launch
from tests.serving.triton_calls import run_one, run_streams, scrape, token_inputs, wait_for_metric

pytestmark = pytest.mark.server

IDS = [1, 504, 3, 28, 1010, 30]
FLOOD = 10


@pytest.fixture(scope="module")
def fair(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Launched]:
    """Two running requests at most, so that the order of admission decides who waits."""
    root = tmp_path_factory.mktemp("tenants")
    launched = launch(root, "--engine-option", "scheduling_policy=fair", "--max-num-seqs", "2", "--max-model-len",
                      "512", "--pool-bytes", "96MiB")  # fmt: skip
    try:
        yield launched
    finally:
        _stop(launched.process, launched.log)


def _sampling(tenant: str, **more: object) -> dict[str, object]:
    return {"temperature": 0, "ignore_eos": True, "tenant": tenant, **more}


def test_a_light_tenant_is_served_ahead_of_a_floods_backlog(fair: Launched) -> None:
    """The flood's ten requests are queued first; under fcfs the light tenant's two would get the last first
    tokens (positions 10 and 11); under fair it is served as soon as its share comes round."""
    requests = {f"flood-{i}": token_inputs(IDS, 24, sampling=_sampling("flood")) for i in range(FLOOD)}
    requests |= {f"light-{i}": token_inputs(IDS, 24, sampling=_sampling("light")) for i in range(2)}
    results = run_streams(fair.grpc_url, "slora", requests)
    assert all(r.error is None and r.finish_reason == "length" for r in results.values()), results
    order = sorted(results, key=lambda name: results[name].first_token_at or float("inf"))
    light = [order.index(f"light-{i}") for i in range(2)]
    assert max(light) <= 5, order


def test_a_request_past_its_slo_is_refused_and_nothing_leaks(fair: Launched) -> None:
    """Both slots are busy for 160 steps: a request whose first token is due in 50 ms is refused (on a
    stream of its own: a stream's errors name no request), the others finish, and no KV page stays held. The busy
    requests are long so that a slot cannot free within the deadline however late the running gauge is read."""
    busy = {f"busy-{i}": token_inputs(IDS, 160, sampling=_sampling("flood")) for i in range(2)}
    # The gauge is published every 0.1 s: an earlier test's last requests could still show as running, and then
    # the hurried request would race the busy ones (and, a light tenant under fair, go first).
    wait_for_metric(fair.metrics_url, 'slora_requests{state="running"}', lambda n: n == 0)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_streams, fair.grpc_url, "slora", busy)
        wait_for_metric(fair.metrics_url, 'slora_requests{state="running"}', lambda n: n >= 2)
        hurried = run_one(fair.grpc_url, "slora", token_inputs(IDS, 8, sampling=_sampling("light", ttft_slo_s=0.05)))
        results = running.result()
    assert hurried.error is not None and "ttft_slo_s=0.05" in hurried.error, hurried
    assert all(r.error is None for r in results.values())
    wait_for_metric(fair.metrics_url, 'slora_pool_pages{kind="kv"}', lambda pages: pages == 0)
    refused = 'slora_requests_refused_total{reason="ttft_slo"}', 'slora_requests_refused_total{reason="ttft_slo_early"}'
    assert any(scrape(fair.metrics_url).get(series, 0) >= 1 for series in refused)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tenant": "bad/name"}, "tenant 'bad/name' is invalid"),
        ({"ttft_slo_s": -1}, "ttft_slo_s"),
        ({"priority": "high"}, "priority"),
    ],  # fmt: skip
)
def test_bad_scheduling_values_are_named(fair: Launched, fields: dict[str, object], message: str) -> None:
    got = run_one(fair.grpc_url, "slora", token_inputs(IDS, 4, sampling={"temperature": 0, **fields}))
    assert got.error is not None and message in got.error, got


def test_tenant_weights_change_at_runtime_and_bad_ones_are_named(fair: Launched) -> None:
    assert set_tenant_weights(fair.http_url, {"light": 2.0})["light"] == 2.0
    with pytest.raises(ServerError, match="weight"):
        set_tenant_weights(fair.http_url, {"light": -1.0})
    assert set_tenant_weights(fair.http_url, {}, replace=True) == {}
