"""Adapter registry at runtime (list / load / unload, multi_lora.json), metrics, and the slora-client CLI."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from slora.backend.engine.defaults import CPU_MAX_BATCH_TOKENS
from slora.backend.engine.sampling_params import SamplingParams
from slora.client import cli
from slora.client.admin import adapter_command
from slora.client.generate import ServerError
from slora.client.perf_input import input_rows
from tests.serving.conftest import MAX_NUM_SEQS, REGISTRY_ADAPTER, Server
from tests.serving.triton_calls import run_one, run_streams, scrape, text_inputs, token_inputs, wait_for_metric

pytestmark = pytest.mark.server

IDS = [1, 504, 3, 28, 1010, 30]


def _generate(server: Server, adapter: str | None, max_tokens: int = 4) -> list[int]:
    got = run_one(server.grpc_url, "slora", token_inputs(IDS, max_tokens, adapter, sampling={"temperature": 0}))
    assert got.error is None, got.error
    return got.token_ids


def _rows(server: Server) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in adapter_command(server.http_url, "list")}


def test_list_reports_every_adapter_with_tier_and_rank(server: Server) -> None:
    _generate(server, "demo-mlp-r16")
    rows = _rows(server)
    assert set(server.demo_adapters) | {"broken", REGISTRY_ADAPTER} <= set(rows)
    assert rows["demo-mlp-r16"]["state"] == "gpu" and rows["demo-mlp-r16"]["rank"] == 16
    assert rows["demo-mlp-r16"]["ranks"] == {"gate_proj": 16, "up_proj": 16, "down_proj": 16}
    assert rows[REGISTRY_ADAPTER]["path"].endswith("extra/for-registry")  # from multi_lora.json
    assert rows["broken"]["state"] == "disk" and rows["broken"]["rank"] is None


def test_load_and_unload_at_runtime(server: Server) -> None:
    with pytest.raises(ServerError, match="'runtime-one'.*adapter_config.json is missing"):
        adapter_command(server.http_url, "load", "runtime-one", str(server.spare_adapter.parent))
    (row,) = adapter_command(server.http_url, "load", "runtime-one", str(server.spare_adapter))
    assert row["state"] == "host" and row["rank"] == 2
    assert _generate(server, "runtime-one") == _generate(server, "demo-o-r2")  # the spare is a copy of it
    assert adapter_command(server.http_url, "unload", "runtime-one") == []
    assert "runtime-one" not in _rows(server)
    got = run_one(server.grpc_url, "slora", token_inputs(IDS, 4, "runtime-one"))
    assert got.error is not None and "'runtime-one' is not registered" in got.error
    with pytest.raises(ServerError, match="folder under the adapter root"):
        adapter_command(server.http_url, "unload", "demo-qv-r4")
    (row,) = adapter_command(server.http_url, "load", "demo-qv-r4")  # from the root into host memory
    assert row["state"] in ("host", "gpu") and row["rank"] == 4


def test_metrics_are_present_and_move(server: Server) -> None:
    before = scrape(server.metrics_url)
    for family in ('slora_pool_pages{kind="free"}', 'slora_pool_pages{kind="adapter"}', "slora_kv_cache_usage_ratio",
                   'slora_adapters{tier="gpu"}', 'slora_adapters{tier="host"}', 'slora_adapters{tier="disk"}',
                   'slora_requests{state="running"}', 'slora_requests{state="waiting"}', "slora_adapter_loads_total",
                   "slora_max_running_requests", "slora_heavy_max_running_requests",
                   "slora_adapter_evictions_total", "slora_adapter_disk_reads_total",
                   "slora_adapter_host_evictions_total", "slora_preemptions_total", "slora_generated_tokens_total",
                   'slora_requests_finished_total{reason="length"}', "slora_time_to_first_token_seconds_count",
                   "slora_inter_token_latency_seconds_count", 'slora_steps_total{kind="decode"}',
                   'slora_steps_total{kind="prompt"}', 'slora_step_seconds_total{kind="prompt"}',
                   'slora_step_wall_seconds_total{kind="decode"}', 'slora_step_copy_wait_seconds_total{kind="prompt"}',
                   'slora_step_requests_total{kind="decode"}', 'slora_step_graphs_total{kind="prompt"}',
                   "slora_step_prompt_tokens_total", "slora_first_response_delay_seconds_count",
                   "slora_responder_busy_seconds_total", 'slora_gc_seconds_total{generation="0"}',
                   'slora_gc_seconds_total{generation="2"}', 'slora_gc_collections_total{generation="1"}'):  # fmt: skip
        assert family in before, family
    # Young collections are rare while serving (backend/runtime/gc_threshold.py), so none may have run yet; the
    # counts are the engine process's own, never negative, with time only where collections ran
    for generation in ("0", "1", "2"):
        count = before[f'slora_gc_collections_total{{generation="{generation}"}}']
        seconds = before[f'slora_gc_seconds_total{{generation="{generation}"}}']
        assert count >= 0 and seconds >= 0 and (seconds == 0 or count > 0), (generation, count, seconds)
    known = len(_rows(server))
    wait_for_metric(server.metrics_url, 'slora_adapters{tier="disk"}', lambda v: v == known)
    wait_for_metric(server.metrics_url, "slora_max_running_requests", lambda v: v == MAX_NUM_SEQS)  # no itl_slo_s
    wait_for_metric(server.metrics_url, "slora_heavy_max_running_requests", lambda v: v == MAX_NUM_SEQS)
    # the limits as the engine resolved them: max_num_seqs given, max_batch_tokens "auto" (the CPU default)
    assert before['slora_engine_limit{limit="max_num_seqs"}'] == MAX_NUM_SEQS
    assert before['slora_engine_limit{limit="max_batch_tokens"}'] == CPU_MAX_BATCH_TOKENS
    tokens = _generate(server, "demo-all-r8", max_tokens=5)
    assert len(tokens) == 5
    # Each series reaches Triton on its own path (engine statistics, or events from the responder), so each is
    # waited for: the last token's response can reach the client before the finish is counted.
    moved = {
        "slora_generated_tokens_total": 5,
        "slora_time_to_first_token_seconds_count": 1,
        "slora_inter_token_latency_seconds_count": 4,
        'slora_requests_finished_total{reason="length"}': 1,
        "slora_step_prompt_tokens_total": len(IDS),  # the prompt, computed in steps with prompts
        'slora_steps_total{kind="prompt"}': 1,
        'slora_steps_total{kind="decode"}': 1,
        "slora_first_response_delay_seconds_count": 1,  # a streamed request's first response
    }
    tenant = 'slora_tenant_time_to_first_token_seconds_count{tenant="demo-all-r8"}'  # its adapter: no tenant given
    moved[tenant] = 1
    before.setdefault(tenant, 0.0)
    for series, increase in moved.items():
        wait_for_metric(server.metrics_url, series, lambda v, s=series, n=increase: v >= before[s] + n)
    after = scrape(server.metrics_url)
    ran = sum(after[f'slora_step_requests_total{{kind="{k}"}}'] - before[f'slora_step_requests_total{{kind="{k}"}}']
              for k in ("decode", "prompt"))  # fmt: skip
    assert ran >= len(tokens)  # one step per token sampled
    assert after['slora_step_seconds_total{kind="prompt"}'] > before['slora_step_seconds_total{kind="prompt"}']
    wait_for_metric(server.metrics_url, "slora_responder_busy_seconds_total",
                    lambda v: v > before["slora_responder_busy_seconds_total"])  # fmt: skip


def test_the_alias_requests_count_in_the_engine_models_metrics(server: Server) -> None:
    """The ensemble alias has its own stub; its requests' latencies and finishes still reach slora's series."""
    before = scrape(server.metrics_url)
    got = run_one(server.grpc_url, "ensemble", text_inputs("Hello there", True, {"temperature": 0, "max_tokens": 5,
                                                                                "ignore_eos": True}))  # fmt: skip
    assert got.error is None and got.finish_reason == "length", got.error
    moved = {
        "slora_time_to_first_token_seconds_count": 1,
        "slora_inter_token_latency_seconds_count": 1,
        'slora_requests_finished_total{reason="length"}': 1,
        'slora_tenant_time_to_first_token_seconds_count{tenant="<base>"}': 1,  # the alias's request, no adapter
    }
    before.setdefault('slora_tenant_time_to_first_token_seconds_count{tenant="<base>"}', 0.0)
    for series, increase in moved.items():
        wait_for_metric(server.metrics_url, series, lambda v, s=series, n=increase: v >= before[s] + n)


def test_gateway_lora_info_gauge(server: Server) -> None:
    """vllm:lora_requests_info names the running adapters (opt-in --lora-info-metric) in its newest series, whose
    value is the time of the update; when the request ends, that series gives way to an idle one, and the page
    settles to that one series (a new label set's series comes before the old one goes, so two at most)."""
    started = time.time()
    inputs = token_inputs(IDS, 64, "demo-o-r2", sampling={"temperature": 0, "ignore_eos": True})
    with ThreadPoolExecutor(1) as pool:
        request = pool.submit(run_one, server.grpc_url, "slora", inputs)
        running = _lora_series_until(server, lambda labels: 'running_lora_adapters="demo-o-r2"' in labels)
        assert request.result().finish_reason == "length"
    assert f'max_lora="{MAX_NUM_SEQS}"' in running[0] and running[1] >= started - 1
    idle = _lora_series_until(server, lambda labels: 'running_lora_adapters=""' in labels)
    assert idle[1] >= running[1]
    _lora_series_until(server, lambda labels: 'running_lora_adapters=""' in labels, alone=True)


def _lora_series_until(
    server: Server, predicate: Any, timeout_s: float = 30.0, alone: bool = False
) -> tuple[str, float]:
    """The newest vllm:lora_requests_info series (by value), once its labels satisfy `predicate` (and, if
    `alone`, once it is the only one); never more than two."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        series = [(k, v) for k, v in scrape(server.metrics_url).items() if k.startswith("vllm:lora_requests_info{")]
        assert len(series) <= 2, series
        newest = max(series, key=lambda kv: kv[1], default=None)
        if newest is not None and predicate(newest[0]) and (len(series) == 1 or not alone):
            return newest
        time.sleep(0.05)
    raise AssertionError(f"no vllm:lora_requests_info series matched within {timeout_s} s")


def test_client_cli(server: Server, reference: Any, capsys: pytest.CaptureFixture[str]) -> None:
    urls = ["--url", server.grpc_url, "--http-url", server.http_url, "--metrics-url", server.metrics_url]
    expected = reference.generate(["Hello!"], ["demo-qv-r4"], [SamplingParams(max_tokens=6, temperature=0.0)])[0]
    for protocol in ("grpc", "http"):
        assert cli.main([*urls, "generate", "Hello!", "--adapter", "demo-qv-r4", "--max-tokens", "6",
                         "--temperature", "0", "--protocol", protocol]) == 0  # fmt: skip
        assert capsys.readouterr().out == expected.text + "\n"
    assert cli.main([*urls, "adapters", "list"]) == 0
    assert "demo-mlp-r16" in capsys.readouterr().out
    assert cli.main([*urls, "health"]) == 0
    assert "model ensemble: ready" in capsys.readouterr().out
    assert cli.main([*urls, "metrics"]) == 0
    assert 'slora_pool_pages{kind="kv"}' in capsys.readouterr().out
    assert cli.main([*urls, "steps", "--window", "0.2"]) == 0
    header = ["kind", "steps", "mean", "ms", "wall", "ms", "requests", "prompt", "tokens", "graphs", "%"]
    assert capsys.readouterr().out.splitlines()[1].split() == header
    assert cli.main([*urls, "steps", "--window", "0"]) == 1
    assert cli.main([*urls, "generate", "Hi", "--adapter", "nope"]) == 1


def test_perf_analyzer_input_rows_are_valid_requests(server: Server) -> None:
    """The rows of perf/perf_analyzer.sh's input file, replayed as requests: every adapter id is served."""
    adapters = [*server.demo_adapters, REGISTRY_ADAPTER]
    for target in ("slora", "ensemble"):
        rows = input_rows(target, adapters, rows=6, prompt_tokens=8, max_tokens=3, vocab=30000, seed=1)
        assert {row["adapter_id"][0] for row in rows} <= {"", *adapters}
        requests = {}
        for i, row in enumerate(rows):
            sampling = json.loads(row["sampling_parameters"][0])
            adapter = row["adapter_id"][0] or None
            if target == "slora":
                requests[f"p{i}"] = token_inputs(row["input_ids"]["content"], row["max_tokens"][0], adapter,
                                                 stream=True, sampling=sampling)  # fmt: skip
            else:
                requests[f"p{i}"] = text_inputs(row["text_input"][0], True, {**sampling, "max_tokens": 3}, adapter,
                                                exclude_input=True)  # fmt: skip
        results = run_streams(server.grpc_url, target, requests)
        assert all(r.error is None and r.final and r.responses == 3 for r in results.values()), results
