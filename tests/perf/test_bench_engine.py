"""bench_engine replays a trace against a tiny random model and writes sane, complete results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perf import bench_engine
from perf.results import load_results
from perf.trace_steps import load_trace, step_timelines
from perf.workload import TraceConfig, generate_trace, save_trace


@pytest.fixture(scope="module")
def trace_file(tiny_adapters: Path) -> Path:
    config = TraceConfig(num_adapters=6, alpha=0.5, req_rate=40, duration=0.3, input_range=(8, 40),
                         output_range=(4, 24), vocab_size=1024, adapter_prefix="s2-", seed=3)  # fmt: skip
    return save_trace(generate_trace(config), tiny_adapters.parent / "trace.jsonl")


def _run(model: Path, adapters: Path, out: Path, *runs: str, extra: tuple[str, ...] = ()) -> dict:
    bench_engine.main(["--model", str(model), "--adapter-root", str(adapters), "--device", "cpu",
                       "--warmup-requests", "2", "--out", str(out), *extra, *runs])  # fmt: skip
    return load_results(out)


def test_three_modes_complete_every_request(tiny_model: Path, tiny_adapters: Path, trace_file: Path,
                                            tmp_path: Path) -> None:  # fmt: skip
    out = tmp_path / "results.json"
    data = _run(tiny_model, tiny_adapters, out, str(trace_file), f"{trace_file}@base", f"{trace_file}@single",
                extra=("--profile", "1", "5", "2", "--profile-file", str(tmp_path / "profile.txt")))  # fmt: skip
    runs = {r["options"]["mode"]: r for r in data["runs"]}
    assert set(runs) == {"lora", "base", "single"}
    for run in runs.values():
        m = run["metrics"]
        assert run["kind"] == "engine" and run["trace"]["num_requests"] == 12
        assert m["num_finished"] == 12 and m["num_failed"] == 0 and m["num_short"] == 0
        assert m["throughput_rps"] > 0 and m["output_tok_s"] > 0 and m["duration_s"] > 0
        assert 0 < m["ttft_s"]["p50"] <= m["ttft_s"]["p99"] <= m["e2e_s"]["p99"]
        assert 0 <= m["slo_attainment"] <= 1 and 0 <= m["user_satisfaction"] <= 1
        assert m["engine_steps"] > 0 and run["env"]["commit"]
        assert m["triton_compiles"] == 0  # the torch kernels on CPU compile nothing
        roof = m["roofline"]  # the H200's least time for this trace, far below a CPU's
        assert roof["num_requests"] == 12 and 0 < m["roofline_fraction"] < 1
        config = run["options"]["engine"]["config"]
        assert roof["limits"]["max_num_seqs"] == config["max_num_seqs"] and roof["dtype_bytes"] == 4  # float32
        kinds = m["step_kinds"]  # on CPU no graphs: prompts make mixed steps, then eager decode steps
        assert set(kinds) == {"mixed", "decode"}, kinds
        assert sum(k["steps"] for k in kinds.values()) == m["engine_steps"]
        assert kinds["decode"]["mean_tokens"] == kinds["decode"]["mean_seqs"] >= 1
        assert kinds["mixed"]["mean_tokens"] > kinds["mixed"]["mean_seqs"]
        gc = m["gc"]  # the process's collections inside the clock, each generation's with its time
        assert set(gc) == {"0", "1", "2"}
        assert all(g["collections"] >= 0 and (g["seconds"] > 0) == (g["collections"] > 0) for g in gc.values())
        for tally in kinds.values():  # the runner's phases and the rest of the step add up to the step
            phases = [tally[f"{p}_ms"] for p in ("build", "wait", "launch", "sample")]
            assert min(phases) >= 0 and tally["launch_ms"] > 0 and tally["other_ms"] >= 0
            assert sum(phases) + tally["other_ms"] == pytest.approx(tally["mean_ms"])
    assert runs["lora"]["trace"]["distinct_adapters"] > 1
    assert runs["single"]["trace"]["distinct_adapters"] == 1
    assert runs["base"]["trace"]["distinct_adapters"] == 0 and runs["base"]["metrics"]["adapter_loads"] == 0
    assert runs["base"]["metrics"]["roofline"]["bytes"]["adapters"] == 0, "the base run reads no adapter"
    assert runs["lora"]["metrics"]["roofline"]["bytes"]["adapters"] > 0
    assert runs["lora"]["metrics"]["adapter_loads"] >= runs["lora"]["trace"]["distinct_adapters"]
    # LoRA tables: built for each new adapter list (the first step with adapters at least), none without adapters
    assert (
        runs["lora"]["metrics"]["lora_tables"]["built"] >= 1 and runs["single"]["metrics"]["lora_tables"]["built"] >= 1
    )
    assert runs["base"]["metrics"]["lora_tables"] == {"built": 0, "reused": 0}
    profile = (tmp_path / "profile.txt").read_text()
    assert "== torch.profiler 2 step(s)" in profile and "aten::" in profile
    assert "== cProfile of 2 step(s)" in profile and "engine.py" in profile
    assert "from step 1 of" in profile and "from step 5 of" in profile
    json.dumps(data)  # plain JSON all the way down


def test_profile_replay_profiles_the_adapter_run_and_the_base_run(
    tiny_model: Path, tiny_adapters: Path, trace_file: Path, tmp_path: Path
) -> None:
    out, profile_file = tmp_path / "results.json", tmp_path / "profile.txt"
    data = _run(tiny_model, tiny_adapters, out, str(trace_file), f"{trace_file}@base", f"{trace_file}@single",
                extra=("--profile-replay", "2", "3", "--profile-file", str(profile_file),
                       "--profile-trace-dir", str(tmp_path / "traces")))  # fmt: skip
    assert len(data["runs"]) == 3, "the replays add no measured run"
    profile = profile_file.read_text()
    for mode in ("single", "base"):  # the last run with adapters, then the base model's
        title = f"from step 2 of a real-time replay of {trace_file.name}@{mode} on torch"
        assert "== torch.profiler 3 step(s): " in profile and profile.count(title) == 3, (mode, profile[:300])
        trace = load_trace(tmp_path / "traces" / f"trace-{trace_file.stem}-{mode}.json.gz")
        steps = step_timelines(trace)  # on CPU: three steps' host spans, no device operations
        assert len(steps) == 3 and all(t.host_ms > 0 and t.launches == 0 for t in steps)
    assert profile.count("== steps' timelines, torch.profiler window of 3 step(s)") == 2
    assert profile.count("| eager | ") == 6
    assert profile.index("@single") < profile.index("@base")
    assert "@lora" not in profile
    assert "== cProfile of 3 step(s)" in profile and "engine.py" in profile


def test_time_limit_aborts_and_counts_unfinished(tiny_model: Path, tiny_adapters: Path, trace_file: Path,
                                                 tmp_path: Path) -> None:  # fmt: skip
    data = _run(tiny_model, tiny_adapters, tmp_path / "r.json", str(trace_file), extra=("--time-limit", "0.05"))
    m = data["runs"][0]["metrics"]
    assert m["num_unfinished"] > 0 and m["num_finished"] + m["num_unfinished"] + m["num_failed"] == 12
    assert m["slo_attainment"] < 1


def test_adapters_beyond_the_host_budget_are_read_off_the_replay_thread(
    tiny_model: Path, tiny_adapters: Path, trace_file: Path, tmp_path: Path
) -> None:
    """With room in host memory for about one S2 adapter (the largest is 224 KiB), requests whose adapter was dropped
    wait for its read on an intake thread, as on a server, and every request still completes."""
    data = _run(tiny_model, tiny_adapters, tmp_path / "r.json", str(trace_file), extra=("--host-budget", "256KiB"))
    m = data["runs"][0]["metrics"]
    assert m["num_finished"] == 12 and m["num_failed"] == 0, m
    assert m["cold_adapter_requests"] > 0
    roomy = _run(tiny_model, tiny_adapters, tmp_path / "roomy.json", str(trace_file))
    assert roomy["runs"][0]["metrics"]["cold_adapter_requests"] == 0  # preloaded: none waits for the disk


def test_bad_run_spec_is_refused() -> None:
    with pytest.raises(ValueError, match="mode"):
        bench_engine.RunSpec.parse("trace.jsonl@merged")
