"""bench_tenants_served against real CPU Triton servers (slora-serve, the default model, two batch slots so that
a small overload queues): a fair server given by --url, whose capacity burst, noisy neighbour and overload runs
account for every request per tenant; and an early-abort server the benchmark starts itself, which refuses the
requests that cannot get their first token within the SLO, counted as refused, not as errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from perf import bench_tenants_served as served
from perf.bench_serving import ServingOptions
from perf.results import load_results
from perf.serve_process import ServeProcess
from perf.tenant_suites import SMOKE
from perf.triton_protocol import ModelIO
from perf.workload import TraceRequest

REPO = Path(__file__).resolve().parents[2]
SLOTS = ["--max-num-seqs", "2"]
SIZES = ["--smoke", "--duration", "1", "--capacity-requests", "8", "--loads", "4", "--time-limit", "120",
         "--no-progress"]  # fmt: skip
ADAPTERS = [f"s1-{i:04d}" for i in range(SMOKE.tenants + 1)]

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def fair_server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[ServeProcess]:
    if not (REPO / "model_repository" / "slora" / "config.pbtxt").is_file():
        pytest.skip("model_repository/slora is missing")
    root = tmp_path_factory.mktemp("fair")
    args = [*served.smoke_serve_args(root, SMOKE.tenants), *SLOTS, "--engine-option", "scheduling_policy=fair"]
    with ServeProcess(args, root / "server.log", ready_timeout_s=300, env=dict(served.SMOKE_ENV)) as server:
        yield server


def _accounted(run: dict[str, Any]) -> None:
    """Every offered request finished or was refused, and each tenant that sent requests has its record."""
    m = run["metrics"]
    assert m["num_finished"] + m["slo"]["refused"] == m["num_requests"] == m["slo"]["offered"], run["name"]
    assert m["num_unfinished"] == 0 and m["stream_errors"] == 0, (run["name"], m["first_errors"])
    assert sum(t["requests"] for t in m["tenants"].values()) == m["num_requests"]
    assert sum(t["finished"] for t in m["tenants"].values()) == m["num_finished"]
    for figures in m["tenants"].values():
        slowest = [s["ttft_s"] for s in figures["ttft_slowest"]]
        assert slowest == sorted(slowest, reverse=True) and len(slowest) == min(3, figures["finished"])
        assert not slowest or slowest[0] >= figures["ttft_p90_s"]  # the latest first token of all


def _steps_cover_the_run(run: dict[str, Any]) -> None:
    """The server's steps during the run computed every prompt of its requests and ran each request once per token
    it sampled (more with a preemption's recomputation; the server ran nothing else meanwhile)."""
    steps, trace = run["metrics"]["steps"], run["trace"]
    prompt, decode = steps["prompt"], steps["decode"]
    assert prompt["steps"] >= 1 and prompt["mean_ms"] > 0, run["name"]
    prompt_tokens = prompt["prompt_tokens_per_step"] * prompt["steps"]
    assert prompt_tokens >= round(trace["mean_input_len"] * trace["num_requests"]) - 1e-6, run["name"]
    ran = prompt["mean_requests"] * prompt["steps"] + (decode["mean_requests"] or 0) * decode["steps"]
    assert ran >= trace["total_output_tokens"] - 1e-6, run["name"]


def _server_saw_every_first_token(run: dict[str, Any]) -> None:
    """The server's first-token histogram grew by one observation per request that got a token in the run, and its
    quantiles fall inside the histogram's range; so do those of each tenant's histogram."""
    server = run["metrics"]["server_ttft"]
    assert server["requests"] == run["metrics"]["num_finished"], run["name"]
    assert 0 < server["p50_s"] <= server["p90_s"] <= 60.0, run["name"]
    for tenant, figures in run["metrics"]["tenants"].items():  # each tenant's own histogram
        if figures["finished"]:
            assert 0 < figures["server_ttft_p50_s"] <= figures["server_ttft_p90_s"] <= 60.0, (run["name"], tenant)


def test_a_fair_server_accounts_for_every_request_of_every_tenant(fair_server: ServeProcess, tmp_path: Path) -> None:
    out = tmp_path / "fair.json"
    served.main(["--url", fair_server.grpc_url, "--metrics-url", fair_server.metrics_url, *SIZES, "--out", str(out)])
    runs = {r["name"]: r for r in load_results(out)["runs"]}
    assert set(runs) == {"tenants-served-capacity", "tenants-served-noisy-fair-without",
                         "tenants-served-noisy-fair-with", "tenants-served-overload-4x-fair"}  # fmt: skip
    for run in runs.values():
        assert run["kind"] == "served" and run["group"] == "tenants"
        assert run["options"]["engine"]["scheduling_policy"] == "fair" and run["options"]["server"]["url"]
        assert run["metrics"]["slo"]["refused"] == 0  # no SLO on this server
        _accounted(run)
        _steps_cover_the_run(run)
        _server_saw_every_first_token(run)
    capacity = runs["tenants-served-capacity"]["metrics"]
    assert capacity["num_finished"] == 8 and capacity["capacity_rps"] > 0
    assert set(capacity["tenants"]) == set(ADAPTERS)  # the burst goes round every tenant's adapter
    for run in runs.values():  # a record for each tenant that sent requests, named as it was sent
        tenants = run["metrics"]["tenants"]
        assert len(tenants) == run["trace"]["distinct_adapters"] and set(tenants) <= set(ADAPTERS), run["name"]
    comparison = runs["tenants-served-noisy-fair-with"]["metrics"]["vs_without"]
    assert set(comparison) >= {"min_throughput_ratio", "max_ttft_p90_ratio", "noisy_share", "tenants"}
    assert runs["tenants-served-overload-4x-fair"]["metrics"]["load"] == 4.0


def test_early_abort_refuses_requests_past_their_slo(tmp_path: Path, default_model_dir: Path) -> None:
    """Arrivals at four times a capacity far above what two CPU slots serve: requests queue behind ones that take
    seconds, so some cannot get a first token within 0.25 s and the server refuses them."""
    if not (REPO / "model_repository" / "slora" / "config.pbtxt").is_file():
        pytest.skip("model_repository/slora is missing")
    out = tmp_path / "early.json"
    served.main([*SIZES, "--suite", "overload", "--modes", "early-abort", "--capacity", "5", "--slo", "0.25",
                 "--server-log-dir", str(tmp_path / "logs"), "--out", str(out), "--", *SLOTS])  # fmt: skip
    (run,) = load_results(out)["runs"]
    assert run["name"] == "tenants-served-overload-4x-early-abort" and run["kind"] == "served"
    engine = run["options"]["engine"]
    assert engine["ttft_slo_s"] == 0.25 and engine["early_abort"] and engine["max_num_seqs"] == 2
    _accounted(run)
    m = run["metrics"]
    assert m["slo"]["refused"] >= 1 and m["num_failed"] == m["slo"]["refused"]
    assert sum(m["refusals"].values()) == m["slo"]["refused"] and m["refusals_unattributed"] == 0
    assert m["slo"]["attainment_admitted"] is None or m["slo"]["attainment_admitted"] >= m["slo"]["attainment_all"]
    assert (tmp_path / "logs").is_dir() and list((tmp_path / "logs").glob("*.log"))
    assert m["steps"]["prompt"]["steps"] >= 1  # a server started here is scraped on its own metrics port


class _Input:
    def __init__(self, name: str, shape: list[int], datatype: str) -> None:
        self.name = name

    def set_data_from_numpy(self, array: Any) -> None:
        self.array = array


class _Client:
    infer_input = _Input


def test_each_request_names_its_adapter_and_its_tenant_in_its_parameters() -> None:
    request = TraceRequest(3, 0.0, "s1-0002", (5, 6, 7), 4)
    replay = served.TenantReplay(_Client(), served.TARGET, ModelIO(), [request], ServingOptions(), None, len)
    sent = replay.stream_request(request, "r3")
    assert sent["parameters"] == {"adapter_id": "s1-0002", "tenant": "s1-0002"} and sent["request_id"] == "r3"
    assert "adapter_id" not in {i.name for i in sent["inputs"]}


@pytest.mark.parametrize(
    ("message", "parsed"),
    [
        (
            "request 'r12-7' refused: its first token cannot come within ttft_slo_s=0.5 s: it waited 0.51 s",
            ("r12", "ttft_slo"),
        ),
        (
            "request 'r3-40' refused: its first token cannot come within ttft_slo_s=6 s: expected 7.2 s after arrival "
            "at the measured rates",
            ("r3", "ttft_slo_early"),
        ),
        ("request 'r9-2' refused: queue_timeout_s=30 s passed while it waited", ("r9", "queue_timeout")),
        ("refused: its first token cannot come within ttft_slo_s=1 s: it waited 1 s", (None, "ttft_slo")),
        ("48 requests are waiting (max_waiting=48); try again later", None),
        ("adapter 'x' is not registered and not found in the adapter root", None),
    ],  # fmt: skip
)
def test_slo_refusals_are_told_from_other_errors(message: str, parsed: tuple[str | None, str] | None) -> None:
    assert served.parse_refusal(message) == parsed
