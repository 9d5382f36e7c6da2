"""client/steps.py: the engine's steps over a window, from two scrapes of the step counters."""

from __future__ import annotations

import http.server
import threading

import pytest

from slora.client import cli
from slora.client.server_ttft import responder_figures, server_ttft, server_ttft_by_tenant
from slora.client.steps import format_summary, parse_steps, step_summary

PAGE = """# HELP slora_steps_total Engine steps by kind
# TYPE slora_steps_total counter
slora_steps_total{kind="decode"} 10
slora_steps_total{kind="prompt"} 4
slora_step_seconds_total{kind="decode"} 0.1
slora_step_seconds_total{kind="prompt"} 0.12
slora_step_wall_seconds_total{kind="decode"} 0.15
slora_step_wall_seconds_total{kind="prompt"} 0.2
slora_step_copy_wait_seconds_total{kind="decode"} 0
slora_step_copy_wait_seconds_total{kind="prompt"} 0.01
slora_step_requests_total{kind="decode"} 50
slora_step_requests_total{kind="prompt"} 12
slora_step_graphs_total{kind="decode"} 10
slora_step_graphs_total{kind="prompt"} 1
slora_step_prompt_tokens_total 400
slora_generated_tokens_total 62
"""


def test_parse_reads_the_step_counters_only() -> None:
    counters = parse_steps(PAGE)
    assert counters == {"slora_steps_total:decode": 10, "slora_steps_total:prompt": 4,
                        "slora_step_seconds_total:decode": 0.1, "slora_step_seconds_total:prompt": 0.12,
                        "slora_step_wall_seconds_total:decode": 0.15, "slora_step_wall_seconds_total:prompt": 0.2,
                        "slora_step_copy_wait_seconds_total:decode": 0,
                        "slora_step_copy_wait_seconds_total:prompt": 0.01, "slora_step_requests_total:decode": 50,
                        "slora_step_requests_total:prompt": 12,
                        "slora_step_graphs_total:decode": 10, "slora_step_graphs_total:prompt": 1,
                        "prompt_tokens": 400}  # fmt: skip


def test_the_summary_is_of_the_window_between_the_scrapes() -> None:
    before = parse_steps(PAGE)
    after = dict(before)
    after.update({"slora_steps_total:decode": 30, "slora_step_seconds_total:decode": 0.3,
                  "slora_step_requests_total:decode": 250, "slora_steps_total:prompt": 8,
                  "slora_step_seconds_total:prompt": 0.24, "slora_step_requests_total:prompt": 32,
                  "slora_step_graphs_total:decode": 25, "slora_step_graphs_total:prompt": 2,
                  "slora_step_wall_seconds_total:decode": 0.39, "slora_step_wall_seconds_total:prompt": 0.4,
                  "slora_step_copy_wait_seconds_total:prompt": 0.025, "prompt_tokens": 1200})  # fmt: skip
    summary = step_summary(before, after)
    assert summary is not None
    assert summary["decode"] == {"steps": 20, "mean_ms": pytest.approx(10.0), "mean_wall_ms": pytest.approx(12.0),
                                 "copy_wait_s": 0.0, "mean_requests": 10.0, "graph_share": 0.75}  # fmt: skip
    assert summary["prompt"] == {"steps": 4, "mean_ms": pytest.approx(30.0), "mean_wall_ms": pytest.approx(50.0),
                                 "copy_wait_s": pytest.approx(0.015), "mean_requests": 5.0, "graph_share": 0.25,
                                 "prompt_tokens_per_step": 200.0}  # fmt: skip
    old = {k: v for k, v in after.items() if "wall" not in k}  # a server from before the wall counter
    assert step_summary(old, old)["decode"]["mean_wall_ms"] is None  # type: ignore[index]
    assert step_summary(before, old)["prompt"]["mean_wall_ms"] is None  # type: ignore[index]
    older = {k: v for k, v in after.items() if "copy_wait" not in k}  # a server from before the copy-wait counter
    assert step_summary(older, older)["prompt"]["copy_wait_s"] is None  # type: ignore[index]


def _histogram(counts: dict[str, int]) -> str:
    """A page with the server's first-token buckets (cumulative counts by bound, as Triton writes them)."""
    rows = [f'slora_time_to_first_token_seconds_bucket{{le="{le}"}} {n}' for le, n in counts.items()]
    return PAGE + "\n".join([*rows, f"slora_time_to_first_token_seconds_count {counts['+Inf']}"]) + "\n"


def test_the_servers_first_tokens_are_the_windows_bucket_growth_interpolated() -> None:
    """Five first tokens before the window (all under 0.05 s); in it 20 under 0.05 s, 20 in (0.05, 0.1], 10 in
    (0.1, 0.2]: the 25th of 50 lies a quarter into (0.05, 0.1], the 45th half-way into (0.1, 0.2]."""
    before = parse_steps(_histogram({"0.05": 5, "0.1": 5, "0.2": 5, "+Inf": 5}))
    after = parse_steps(_histogram({"0.05": 25, "0.1": 45, "0.2": 55, "+Inf": 55}))
    assert after["slora_steps_total:decode"] == 10  # the step counters are read from the same page
    assert server_ttft(before, after) == {"requests": 50, "p50_s": pytest.approx(0.0625), "p90_s": pytest.approx(0.15)}


def test_the_servers_first_tokens_without_a_bound_or_a_histogram_or_a_token() -> None:
    before = parse_steps(_histogram({"0.05": 0, "0.1": 0, "+Inf": 0}))
    slow = parse_steps(_histogram({"0.05": 9, "0.1": 9, "+Inf": 10}))  # the 90th percentile: 9 of 10, the bound
    assert server_ttft(before, slow) == {"requests": 10, "p50_s": pytest.approx(0.05 * 5 / 9),
                                         "p90_s": pytest.approx(0.05)}  # fmt: skip
    slower = parse_steps(_histogram({"0.05": 5, "0.1": 5, "+Inf": 10}))
    assert server_ttft(before, slower) == {"requests": 10, "p50_s": pytest.approx(0.05), "p90_s": None}
    assert server_ttft(before, before) == {"requests": 0, "p50_s": None, "p90_s": None}
    assert server_ttft(parse_steps(PAGE), parse_steps(PAGE)) is None  # a server without the histogram
    assert server_ttft(None, before) is None and server_ttft(before, None) is None


def _tenants_page(counts: dict[str, dict[str, int]]) -> str:
    """A page with each tenant's first-token buckets, labels in the order Triton writes them (the series' own, then
    the bound)."""
    rows = [f'slora_tenant_time_to_first_token_seconds_bucket{{tenant="{tenant}",le="{le}"}} {n}'
            for tenant, buckets in counts.items() for le, n in buckets.items()]  # fmt: skip
    return _histogram({"0.05": 0, "+Inf": 0}) + "\n".join(rows) + "\n"


def test_each_tenants_first_tokens_come_from_its_own_buckets() -> None:
    """Tenant names with the punctuation a tenant may have; a tenant without a first token in the window is left
    out; the all-requests histogram is read apart from the tenants'."""
    before = parse_steps(_tenants_page({"org:a@b": {"0.05": 2, "0.1": 2, "+Inf": 2}, "<base>": {"0.05": 1, "+Inf": 1}}))
    after = parse_steps(_tenants_page({"org:a@b": {"0.05": 12, "0.1": 22, "+Inf": 22}, "<base>": {"0.05": 1, "+Inf": 1},
                                       "s1-0003": {"0.05": 0, "+Inf": 4}}))  # fmt: skip
    by_tenant = server_ttft_by_tenant(before, after)
    assert set(by_tenant) == {"org:a@b", "s1-0003"}
    assert by_tenant["org:a@b"] == {"requests": 20, "p50_s": pytest.approx(0.05), "p90_s": pytest.approx(0.09)}
    assert by_tenant["s1-0003"] == {"requests": 4, "p50_s": None, "p90_s": None}  # past the last bound
    assert server_ttft(before, after) == {"requests": 0, "p50_s": None, "p90_s": None}
    assert (
        server_ttft_by_tenant(None, after) == {} and server_ttft_by_tenant(parse_steps(PAGE), parse_steps(PAGE)) == {}
    )


def _responder_page(busy_s: float, delays: dict[str, int]) -> dict[str, float]:
    rows = [f'slora_first_response_delay_seconds_bucket{{le="{le}"}} {n}' for le, n in delays.items()]
    return parse_steps(PAGE + f"slora_responder_busy_seconds_total {busy_s}\n" + "\n".join(rows) + "\n")


def test_the_responders_share_of_the_way_out() -> None:
    """Its busy time's growth over the window, and the first responses' delay from their own buckets."""
    before = _responder_page(2.0, {"0.001": 0, "0.002": 0, "+Inf": 0})
    after = _responder_page(5.0, {"0.001": 5, "0.002": 10, "+Inf": 10})
    assert responder_figures(before, after, 10.0) == {
        "busy_share": pytest.approx(0.3), "first_responses": 10, "first_response_delay_p50_s": pytest.approx(0.001),
        "first_response_delay_p90_s": pytest.approx(0.0018),
    }  # fmt: skip
    assert server_ttft(before, after) is None  # the first-token histogram is another
    assert responder_figures(parse_steps(PAGE), parse_steps(PAGE), 10.0) is None  # a server without the series


def test_no_steps_or_no_scrape_gives_no_means() -> None:
    page = parse_steps(PAGE)
    summary = step_summary(page, page)
    assert summary is not None
    assert summary["decode"] == {"steps": 0, "mean_ms": None, "mean_wall_ms": None, "copy_wait_s": 0.0,
                                 "mean_requests": None, "graph_share": None}  # fmt: skip
    assert summary["prompt"]["prompt_tokens_per_step"] is None
    assert step_summary(None, page) is None and step_summary(page, None) is None


def test_the_table_shows_each_kind_and_dashes_where_nothing_ran() -> None:
    page = parse_steps(PAGE)
    after = {**page, "slora_steps_total:prompt": 6, "slora_step_seconds_total:prompt": 0.18,
             "slora_step_wall_seconds_total:prompt": 0.3, "slora_step_requests_total:prompt": 16,
             "slora_step_graphs_total:prompt": 3, "prompt_tokens": 700}  # fmt: skip
    text = format_summary(step_summary(page, after), 2.0)
    lines = text.splitlines()
    assert lines[0] == "steps in 2 s"
    assert lines[2].split() == ["decode", "0", "-", "-", "-", "-", "-"]
    assert lines[3].split() == ["prompt", "2", "30.0", "50.0", "2.0", "150", "100"]
    assert "no step counters" in format_summary(None, 2.0)


def test_the_cli_says_when_the_port_has_no_counters_or_no_server(caplog: pytest.LogCaptureFixture) -> None:
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the handler's name)
            body = b"nv_inference_count 3\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"127.0.0.1:{server.server_address[1]}"
    try:
        assert cli.main(["--metrics-url", url, "steps", "--window", "0.1"]) == 1
    finally:
        server.shutdown()
        server.server_close()
    assert "has no slora_steps_total" in caplog.text
    assert cli.main(["--metrics-url", url, "steps", "--window", "0.1"]) == 1  # nobody listens there now
    assert "cannot reach the server" in caplog.text


GC_PAGE = """\
slora_gc_seconds_total{generation="0"} 0.5
slora_gc_seconds_total{generation="1"} 0.25
slora_gc_seconds_total{generation="2"} 1
slora_gc_collections_total{generation="0"} 100
slora_gc_collections_total{generation="1"} 10
slora_gc_collections_total{generation="2"} 1
"""


def test_the_engines_collections_in_the_window_by_generation() -> None:
    before = parse_steps(PAGE + GC_PAGE)
    assert before["slora_gc_seconds_total:2"] == 1 and before["slora_gc_collections_total:0"] == 100
    after = {**before, "slora_gc_seconds_total:0": 0.75, "slora_gc_collections_total:0": 150,
             "slora_gc_seconds_total:2": 1.5, "slora_gc_collections_total:2": 3}  # fmt: skip
    summary = step_summary(before, after)
    assert summary is not None
    assert summary["gc"] == {"0": {"seconds": pytest.approx(0.25), "collections": 50},
                             "1": {"seconds": 0.0, "collections": 0},
                             "2": {"seconds": pytest.approx(0.5), "collections": 2}}  # fmt: skip
    old = parse_steps(PAGE)  # a server from before the GC counters
    assert step_summary(old, old)["gc"] is None  # type: ignore[index]
