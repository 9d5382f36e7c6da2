"""bench_serving against the real server: slora-serve on a tiny random model (CPU), both the token model and the
ensemble. Skipped where the model repository or a Triton server is not available."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from perf import bench_serving
from perf.results import load_results
from perf.workload import TraceConfig, generate_trace, save_trace

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.server


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _server_available() -> str | None:
    if not (REPO / "model_repository" / "slora" / "config.pbtxt").is_file():
        return "model_repository/slora is missing"
    try:
        from slora.backend.launcher.server_locator import locate_server  # noqa: F401
    except ImportError as exc:
        return f"the launcher is not available ({exc})"
    return None


@pytest.fixture(scope="module")
def server(
    tiny_model: Path, tiny_adapters: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[int, int]]:
    """The server's gRPC and metrics ports."""
    reason = _server_available()
    if reason:
        pytest.skip(reason)
    http, grpc, metrics = _free_ports(3)
    log = tmp_path_factory.mktemp("server") / "server.log"
    command = [sys.executable, "-m", "slora.backend.launcher.cli", "--model", str(tiny_model), "--adapter-dir",
               str(tiny_adapters), "--device", "cpu", "--engine-option", "load_format=dummy",
               "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
               "--ready-timeout", "120"]  # fmt: skip
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        yield grpc, metrics
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.parametrize("target", ["slora", "ensemble"])
def test_replay_through_triton(server: tuple[int, int], target: str, tiny_model: Path, tmp_path: Path) -> None:
    config = TraceConfig(num_adapters=4, req_rate=40, duration=0.25, input_range=(8, 24), output_range=(4, 16),
                         vocab_size=1024, adapter_prefix="s1-", seed=11)  # fmt: skip
    trace = save_trace(generate_trace(config), tmp_path / "trace.jsonl")
    out = tmp_path / "r.json"
    args = ["--url", f"localhost:{server[0]}", "--target", target, "--ready-timeout", "120", "--warmup-requests", "2",
            "--metrics-url", f"localhost:{server[1]}", "--time-limit", "60", "--out", str(out), str(trace),
            f"{trace}@base"]  # fmt: skip
    if target == "ensemble":
        args += ["--tokenizer", str(tiny_model)]
    else:  # two client processes on one clock, each its share of the requests
        args += ["--clients", "2"]
    bench_serving.main(args)
    runs = load_results(out)["runs"]
    assert [r["options"]["mode"] for r in runs] == ["lora", "base"]
    assert {r["options"]["clients"] for r in runs} == {2 if target == "slora" else 1}
    for run in runs:
        m = run["metrics"]
        assert m["num_finished"] == 10 and m["stream_errors"] == 0, m.get("first_errors")
        assert m["num_short"] == 0 and sum(run["per_request"]["num_output"]) == run["trace"]["total_output_tokens"]
        assert m["ttft_s"]["p50"] > 0 and m["throughput_rps"] > 0
        # the roofline from the served model's parameters: its folder, its adapters, float32 on CPU
        assert m["roofline"]["dtype_bytes"] == 4 and 0 < m["roofline_fraction"] < 1
        # the server's steps during the run (its metrics port): each request ran once per token it sampled
        steps = m["steps"]
        ran = sum(steps[k]["mean_requests"] * steps[k]["steps"] for k in ("decode", "prompt") if steps[k]["steps"])
        assert ran == pytest.approx(run["trace"]["total_output_tokens"]) and steps["prompt"]["mean_ms"] > 0
    adapter_bytes = [run["metrics"]["roofline"]["bytes"]["adapters"] for run in runs]
    assert adapter_bytes[0] > 0 and adapter_bytes[1] == 0, "the base run reads no adapter"
    lora = runs[0]["metrics"]
    assert lora["preload_via"] == "adapter_command"  # host memory only, as in-process
    # The server cannot be asked to empty its pool: adapters of earlier runs stay resident, and this is recorded.
    assert isinstance(lora["adapters_on_gpu_at_start"], int)


def test_headline_and_sweep_through_triton(server: tuple[int, int], tmp_path: Path) -> None:
    """S-LoRA's method in one call, shortened: the n = 4 trace (its capacity), then 50% and 80% of it."""
    out = tmp_path / "r.json"
    bench_serving.main(["--url", f"localhost:{server[0]}", "--headline", "--allow-short-traces", "--duration", "0.25",
                        "--rate", "40", "--num-adapters", "4", "--no-base", "--sweep", "--warmup-requests", "2",
                        "--output-range", "4", "16", "--input-range", "8", "24", "--time-limit", "60",
                        "--out", str(out)])  # fmt: skip
    runs = load_results(out)["runs"]
    assert [r["sweep"]["role"] for r in runs] == ["capacity", "load", "load"]
    assert runs[0]["trace"]["path"].endswith("traces/s1-n4-40rps-0.25s.jsonl")
    assert all(r["metrics"]["num_finished"] == r["metrics"]["num_requests"] for r in runs)
