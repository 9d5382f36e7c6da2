"""The report pairs runs for each target from measured numbers only; plots are written when matplotlib exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from perf.report import report
from perf.results import append_runs, load_results, make_run


def _run(name: str, kind: str, n: int, mode: str, rps: float, trace: str, group: str) -> dict:
    config = {"num_adapters": n, "adapter_prefix": "s1-"}
    metrics = {"throughput_rps": rps, "window_rps": None, "output_tok_s": rps * 260, "num_finished": 10,
               "num_requests": 10, "ttft_s": {"p50": 0.1, "p99": 0.5}, "e2e_s": {"p50": 3.0, "p99": 9.0},
               "slo_attainment": 1.0, "user_satisfaction": 0.99}  # fmt: skip
    per_request = {"ttft": [0.1, 0.2, None], "index": [0, 1, 2]}
    return make_run(name, kind, {"path": f"/x/{trace}.jsonl", "config": config}, {"mode": mode}, metrics,
                    group=group, per_request=per_request)  # fmt: skip


@pytest.fixture
def results(tmp_path: Path) -> Path:
    path = tmp_path / "results.json"
    append_runs(path, [
        _run("e-n5", "engine", 5, "lora", 30.0, "s1-n5", "engine"),
        _run("e-n2000", "engine", 2000, "lora", 27.0, "s1-n2000", "engine"),
        _run("e-base", "engine", 2000, "base", 31.0, "s1-n2000", "engine"),
        _run("s-n2000", "serving", 2000, "lora", 26.0, "s1-n2000", "serving-slora"),
        _run("p-n5", "peft", 5, "lora", 0.5, "s1-n5", "peft"),
    ])  # fmt: skip
    append_runs(path, [_run("e-n5", "engine", 5, "lora", 29.0, "s1-n5", "engine")])  # kept, as e-n5#2
    return path


def test_targets_are_paired_and_judged(results: Path) -> None:
    assert [r["name"] for r in load_results(results)["runs"]][-1] == "e-n5#2"
    text = report(results)
    assert "| s1-2000 | e-n2000 | - | 27.000 req/s | >= 24 req/s | yes |" in text
    assert "| n2000-vs-n5 | e-n2000 | e-n5 | 0.900 x | >= 0.95 x | NO |" in text
    assert "| n2000-vs-n5 | e-n2000 | e-n5#2 | 0.931 x | >= 0.95 x | NO |" in text
    assert "| lora-vs-base | e-n2000 | e-base | 0.871 x | >= 0.9 x | NO |" in text
    assert "| vs-peft | e-n5#2 | p-n5 | 58.000 x | >= 30 x | yes |" in text
    assert "| served | s-n2000 | e-n2000 | 0.963 x | >= 0.9 x | yes |" in text


def test_served_runs_pair_with_engine_runs_of_the_same_kernels(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    engine_bmm = _run("bmm", "engine", 2000, "lora", 10.0, "s1-n2000", "engine-bmm")
    engine_bmm["options"]["engine"] = {"config": {"kernel_backend": "bmm"}}
    engine_triton = _run("tri", "engine", 2000, "lora", 25.0, "s1-n2000", "engine-triton")
    engine_triton["options"]["engine"] = {"config": {"kernel_backend": "triton"}}
    served = _run("srv", "serving", 2000, "lora", 24.0, "s1-n2000", "serving-slora")
    served["options"]["server_kernel_backend"] = "triton"
    append_runs(path, [engine_bmm, engine_triton, served])
    served_lines = [line for line in report(path).splitlines() if line.startswith("| served |")]
    assert served_lines == ["| served | srv | tri | 0.960 x | >= 0.9 x | yes |"]


def test_missing_targets_say_not_run(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    append_runs(path, [_run("e-n5", "engine", 5, "lora", 30.0, "s1-n5", "engine")])
    assert "| vs-peft | not run |" in report(path)


def test_plots_are_written(results: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from perf.plot import plot_all

    written = plot_all([results], tmp_path / "plots")
    assert [p.name for p in written] == ["throughput.png", "scaling.png", "latency.png"]
    assert all(p.stat().st_size > 1000 for p in written)


def test_runs_of_several_files_are_compared(results: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.json"
    append_runs(other, [_run("p-n5", "peft", 5, "lora", 1.0, "s1-n5", "peft")])
    text = report(results, other)
    assert "| vs-peft | e-n5#2 | p-n5#2 | 29.000 x | >= 30 x | NO |" in text


def test_engine_steps_by_kind_and_compiles_are_tabled(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    run = _run("e-n2000", "engine", 2000, "lora", 12.0, "s1-n2000", "engine")
    run["metrics"]["step_kinds"] = {
        "graph": {"steps": 626, "seconds": 13.2, "mean_ms": 21.14, "mean_seqs": 120.3, "mean_tokens": 120.3},
        "mixed_graph": {"steps": 40, "seconds": 0.3, "mean_ms": 7.52, "mean_seqs": 76.3, "mean_tokens": 403.7},
        "mixed": {
            "steps": 189,
            "seconds": 25.8,
            "mean_ms": 136.68,
            "mean_seqs": 230.7,
            "mean_tokens": 907.3,
            "build_ms": 3.0,
            "wait_ms": 0.5,
            "launch_ms": 30.25,
            "sample_ms": 100.0,
            "other_ms": 2.93,
        },
    }
    run["metrics"].update(triton_compiles=3, step_time_share=0.4616, cold_adapter_requests=12)
    served = _run("s-n2000", "serving", 2000, "lora", 9.0, "s1-n2000", "serving-slora")  # no steps: no row
    append_runs(path, [run, served])
    text = report(path)
    assert "## Engine steps by kind" in text
    assert "| e-n2000 | 626, 21.1 (120) | – | 40, 7.5 (76, 404) | 189, 136.7 (231, 907) | 3 | 46% | 12 |" in text
    assert "| s-n2000 |" not in text.split("## Engine steps by kind")[1]
    assert "| e-n2000 | mixed | 136.7 | 3.0 | 0.5 | 30.2 | 100.0 | 2.9 |" in text.split("## Host time")[1]
    assert "| e-n2000 | graph |" not in text, "a tally without phases (older results) gets no row"


def test_engine_runs_host_work_is_tabled(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    run = _run("e-n2000", "engine", 2000, "lora", 12.0, "s1-n2000", "engine")
    run["metrics"].update(engine_steps=855, lora_tables={"built": 600, "reused": 55},
                          gc={"0": {"seconds": 0.2, "collections": 900}, "1": {"seconds": 0.1, "collections": 90},
                              "2": {"seconds": 1.25, "collections": 4}})  # fmt: skip
    older = _run("e-n5", "engine", 5, "lora", 13.0, "s1-n5", "engine")  # results from before the counters: no row
    append_runs(path, [run, older])
    table = report(path).split("## Engine runs' host work: LoRA tables and garbage collections")[1]
    assert "| e-n2000 | 855 | 600 / 55 | 1.55 (4, 1.25) | 990 |" in table
    assert "e-n5" not in table


def test_the_disk_tier_pairs_2000_adapters_with_700_on_one_server(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    runs = [_run("s2-n2000", "serving", 2000, "lora", 27.0, "s2-n2000", "serving-slora"),
            _run("s2-n700", "serving", 700, "lora", 30.0, "s2-n700", "serving-slora"),
            _run("s1-n700", "serving", 700, "lora", 10.0, "s1-n700", "serving-slora")]  # fmt: skip
    for run in runs:
        run["trace"]["config"]["adapter_prefix"] = run["name"][:3]
    append_runs(path, runs)
    rows = [line for line in report(path).splitlines() if line.startswith("| disk-tier |")]
    assert rows == ["| disk-tier | s2-n2000 | s2-n700 | 0.900 x | >= 0.9 x | yes |"]  # not the S1 run


def test_no_steps_section_without_step_kinds(results: Path) -> None:
    text = report(results)
    assert "## Engine steps by kind" not in text and "## Served runs' engine steps" not in text


def test_served_runs_steps_are_tabled(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    served = _run("s-n2000", "serving", 2000, "lora", 9.0, "s1-n2000", "serving-slora")
    served["metrics"]["steps"] = {
        "decode": {
            "steps": 900,
            "mean_ms": 11.26,
            "mean_wall_ms": 12.26,
            "copy_wait_s": 0.0,
            "mean_requests": 247.4,
            "graph_share": 1.0,
        },
        "prompt": {
            "steps": 450,
            "mean_ms": 31.04,
            "mean_wall_ms": 35.04,
            "copy_wait_s": 0.6,
            "mean_requests": 251.0,
            "prompt_tokens_per_step": 612.5,
            "graph_share": 0.6,
        },
        "gc": {"0": {"seconds": 0.05, "collections": 400}, "1": {"seconds": 0.02, "collections": 40},
               "2": {"seconds": 0.31, "collections": 3}},
    }  # fmt: skip
    served["metrics"]["duration_s"] = 30.0
    idle = _run("s-base", "serving", 0, "base", 9.0, "s1-n0", "serving-slora")
    idle["metrics"]["steps"] = {
        "decode": {"steps": 0, "mean_ms": None, "mean_requests": None},  # results from before graph shares
        "prompt": {"steps": 3, "mean_ms": 5.0, "mean_requests": 1.0, "prompt_tokens_per_step": 20.0},
    }
    # overlapped steps: an eager step's launches delay the previous step's read, which moves wall time between kinds
    shifted = _run("s-shift", "serving", 2000, "lora", 9.0, "s1-n2000", "serving-slora")
    shifted["metrics"]["steps"] = {
        "decode": {"steps": 100, "mean_ms": 11.0, "mean_wall_ms": 13.0, "mean_requests": 200.0},
        "prompt": {"steps": 100, "mean_ms": 31.0, "mean_wall_ms": 30.0, "mean_requests": 200.0,
                   "prompt_tokens_per_step": 500.0},
    }  # fmt: skip
    append_runs(path, [served, idle, shifted])
    table = report(path).split("## Served runs' engine steps by kind")[1]
    assert "| –, – | 0.1 | 4.3 / – |" in table
    # the GPU waited 900 x 1 ms + 450 x 4 ms, 0.6 s of it for adapter copies; the steps' wall time,
    # 900 x 12.26 + 450 x 35.04 ms, of the run's 30 s
    # and the engine's garbage collections: 0.38 s in all, 3 full ones of 0.31 s
    row = (
        "| s-n2000 | 900, 11.3 (247) | 450, 31.0 (251, 612) | 100%, 60% | 2.7 (adapter copies 0.60) | 26.8 / 30.0 "
        "| 0.38 (3, 0.31) |"
    )
    assert row in table
    # results from before the wall and the GC counters
    assert "| s-base | 0 | 3, 5.0 (1, 20) | –, – | – | – | – |" in table


def test_served_runs_first_tokens_are_tabled_beside_the_servers(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    served = _run("s-n2000", "serving", 2000, "lora", 9.0, "s1-n2000", "serving-slora")
    served["metrics"]["ttft_s"]["p90"] = 0.25
    served["metrics"]["server_ttft"] = {"requests": 10, "p50_s": 0.0625, "p90_s": None}
    served["metrics"]["responder"] = {"busy_share": 0.35, "first_responses": 10, "first_response_delay_p50_s": 0.0015,
                                      "first_response_delay_p90_s": 0.004}  # fmt: skip
    served["metrics"]["client_cpu_share"] = 0.5
    append_runs(path, [served, _run("s-base", "serving", 0, "base", 9.0, "s1-n0", "serving-slora")])
    table = report(path).split("## Served runs' first tokens: client and server")[1]
    assert "| s-n2000 | 0.100 / 0.250 | 0.062 / – | 10 | 1.5 / 4.0 | 35% | 50% |" in table
    assert "s-base" not in table  # no server histogram recorded


def _with_roofline(run: dict, seconds: float, burst_rps: float, adapter_gb: float, duration: float) -> dict:
    run["metrics"].update(duration_s=duration, roofline_fraction=seconds / duration)
    run["metrics"]["roofline"] = {
        "seconds": seconds, "rps": 10 / seconds, "steps": 400, "memory_bound_steps": 300, "busy_s": seconds / 2,
        "bytes": {"weights": 5.2e12, "lm_head": 0.1e12, "embeddings": 0.0, "kv_read": 1.9e12, "kv_write": 0.1e12,
                  "adapters": adapter_gb * 1e9},
        "flops": {"projections": 30e12, "lm_head": 1e12, "attention": 1e12, "lora": 0.0},
        "burst": {"rps": burst_rps, "seconds": 10 / burst_rps, "busy_s": 1.0, "steps": 100},
        "peaks": {"source": "H200 datasheet"},
    }  # fmt: skip
    return run


def test_roofline_fractions_and_the_bytes_floor_are_reported(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    lora = _with_roofline(_run("e-n2000", "engine", 2000, "lora", 27.0, "s1-n2000", "engine"), 100.0, 40.0, 30.0, 125.0)
    base = _with_roofline(_run("e-base", "engine", 2000, "base", 30.0, "s1-n2000", "engine"), 100.0, 50.0, 0.0, 110.0)
    base["metrics"]["window_rps"] = 29.0
    old = _run("e-n5", "engine", 5, "lora", 29.0, "s1-n5", "engine")  # results written before the roofline
    append_runs(path, [lora, base, old])
    text = report(path)
    runs = text.split("## Runs")[1]
    assert "| roofline req/s | of roofline |" in runs
    assert "| 0.10 | 0.800 |" in runs.split("| e-n2000 |")[1].splitlines()[0]
    assert runs.split("| e-n5 |")[1].splitlines()[0].endswith("| – | – |")
    assert "| base-roofline | not run |" in text, "both traces are limited by their arrivals, not by the GPU"
    roof = text.split("## Roofline of each run")[1]
    row = "| e-n2000 | 400 | 75% | 5300 / 2000 / 30.0 | 32 | 100.00 | 125.00 | 0.800 | 40.00 | – | arrivals |"
    assert row + " H200 datasheet |" in roof  # no window rate recorded
    assert "| 100.00 | 110.00 | 0.909 | 50.00 | 0.580 | arrivals |" in roof  # the base run's window: 29 req/s
    floor = text.split("## LoRA runs against their base run and the bytes floor")[1]
    assert "| e-n2000 | e-base | 0.900 | 1.000 | 0.800 | 1.125 |" in floor


def test_s2_and_s_all_runs_are_checked_against_their_bytes_floor(tmp_path: Path) -> None:
    def run(name: str, setting: str, mode: str, rps: float, burst_rps: float) -> dict:
        out = _with_roofline(_run(name, "serving", 700, mode, rps, f"{setting}-n700", "serving-slora"), 100.0,
                             burst_rps, 0.0, 125.0)  # fmt: skip
        out["trace"]["config"]["adapter_prefix"] = f"{setting}-"
        return out

    path = tmp_path / "r.json"
    s2 = [run("s2", "s2", "lora", 24.0, 40.0), run("s2-base", "s2", "base", 30.0, 50.0)]
    append_runs(path, s2 + [run("sall", "sall", "lora", 10.0, 20.0), run("sall-base", "sall", "base", 30.0, 50.0)])
    text = report(path)
    # S2: 24 / 30 = 0.8 measured against a floor of 40 / 50 = 0.8, all of it; S-all: 1 / 3 against 0.4, short
    assert "| bytes-floor | s2 | s2-base | 1.000 x | >= 0.97 x | yes |" in text
    assert "| bytes-floor | sall | sall-base | 0.833 x | >= 0.97 x | NO |" in text


def test_s1_runs_have_no_bytes_floor_check(results: Path) -> None:
    assert "| bytes-floor | not run |" in report(results)


def test_headline_and_sweep_sections(tmp_path: Path) -> None:
    def served(name: str, rps: float, rate: float, duration: float, sweep: dict | None) -> dict:
        run = _run(name, "serving", 2000, "lora", rps, name, "serving-slora")
        run["trace"]["config"].update(req_rate=rate, duration=duration)
        if sweep is not None:
            run["sweep"] = sweep
        return run

    path = tmp_path / "r.json"
    capacity = {"role": "capacity", "capacity_rps": 36.0, "saturated": True, "loads": [0.5, 0.8]}
    append_runs(path, [
        served("s-cap", 35.0, 60.0, 120.0, capacity),
        served("s-at50", 18.0, 18.0, 120.0, {"role": "load", "load_fraction": 0.5, "capacity_rps": 36.0,
                                              "capacity_run": "s-cap"}),
        served("s-at80", 28.8, 28.8, 120.0, {"role": "load", "load_fraction": 0.8, "capacity_rps": 36.0,
                                              "capacity_run": "s-cap"}),
        served("s-short", 26.0, 40.0, 12.0, None),
    ])  # fmt: skip
    text = report(path)
    head = text.split("## Headline: served, S-LoRA's method")[1].split("##")[0]
    assert "| s-cap | 2000 | lora | 120 | 60.0 | 35.00 | 0.10 / 0.50 | – |  |" in head
    assert "| s-short | 2000 | lora | 12 | 40.0 | 26.00 | 0.10 / 0.50 | – | short trace: the drain weighs |" in head
    assert "s-at50" not in head
    sweep = text.split("## TTFT at fractions of capacity")[1]
    assert "| s-cap | 36.00 | capacity | 60.00 | 35.00 | 0.10 / 0.50 |" in sweep
    assert "| s-cap | 36.00 | 50% | 18.00 | 18.00 | 0.10 / 0.50 |" in sweep
    assert "| s-cap | 36.00 | 80% | 28.80 | 28.80 | 0.10 / 0.50 |" in sweep
    targets = text.split("## Targets")[1].split("##")[0]
    assert "| s1-2000 | s-cap |" in targets and "s-at50" not in targets, "a load run is no throughput figure"


def test_base_runs_are_judged_against_a_roofline_the_gpu_limits(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    saturated = _with_roofline(
        _run("e-base", "engine", 2000, "base", 30.0, "s1-n2000", "engine"), 100.0, 0.1, 0.0, 110.0
    )
    append_runs(path, [saturated])
    assert "| base-roofline | e-base | roofline | 0.909 x | >= 0.7 x | yes |" in report(path)
    assert "| 0.909 | 0.10 | – | GPU |" in report(path).split("## Roofline of each run")[1]
