"""perf.roofline: the ideal engine's steps, bytes, FLOPs and time on a case worked out by hand, and the model costs
of the shapes users run against their published parameter counts."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from perf import roofline
from perf.make_adapters import SETTINGS, WEIGHTS_FILE
from perf.make_model import SHAPES, write_model_dir
from perf.roofline import AdapterCost, Limits, ModelCost, Peaks, Work, simulate
from slora.backend.model.spec import ModelSpec

# Round numbers, so that every step can be followed by hand (the test's comments do).
MODEL = ModelCost(weight_bytes=1000, lm_head_bytes=100, embed_row_bytes=1, kv_bytes_per_token=10,
                  projection_flops_per_token=100, lm_head_flops_per_token=50, attention_flops_per_pair=1)  # fmt: skip
ADAPTERS = {"a": AdapterCost(bytes=20, flops_per_token=4)}
LIMITS = Limits(max_num_seqs=2, max_batch_tokens=4)
PEAKS = Peaks(hbm_bytes_s=1000.0, flop_s=400.0, source="test")
WORKS = [
    Work(arrival=0.0, input_len=3, output_len=2, adapter="a"),
    Work(arrival=0.0, input_len=2, output_len=1, adapter=None),
    Work(arrival=10.0, input_len=1, output_len=1, adapter="a"),
]


def test_hand_computed_trace() -> None:
    """Step 1 (t=0): A's whole prompt (3 tokens, its first output) and 1 of B's 2 prompt tokens, budget 4:
        bytes 1000 + 100 (logits for A) + 4 (rows) + 0 (KV read) + 40 (KV written) + 20 (adapter a) = 1164
        FLOPs 400 + 50 + 7 (pairs: A 1+2+3, B 1) + 12 (a: 3 tokens x 4) = 469: 1.1725 s, bound by FLOPs
    Step 2: A decodes at position 3, B's last prompt token at position 1 (its only output):
        bytes 1000 + 100 + 2 + 40 (KV of 3 + 1 positions) + 20 + 20 = 1182; FLOPs 200 + 100 + 6 (4 + 2) + 4 = 310:
        1.182 s; A and B are done at 2.3545 s
    Nothing runs until C arrives at 10 s. Step 3: C's 1-token prompt: bytes 1000 + 100 + 1 + 0 + 10 + 20 = 1131,
        FLOPs 100 + 50 + 1 + 4 = 155: 1.131 s; done at 11.131 s."""
    roof = simulate(WORKS, MODEL, ADAPTERS, LIMITS, PEAKS)
    assert roof.steps == 3 and roof.memory_bound_steps == 2
    assert roof.seconds == pytest.approx(11.131) and roof.busy_s == pytest.approx(1.1725 + 1.182 + 1.131)
    assert roof.num_requests == 3 and roof.output_tokens == 4
    assert roof.bytes == {"weights": 3000, "lm_head": 300, "embeddings": 7, "kv_read": 40, "kv_write": 70,
                          "adapters": 60}  # fmt: skip
    assert roof.flops == {"projections": 700, "lm_head": 200, "attention": 14, "lora": 20}
    assert roof.rps == pytest.approx(3 / 11.131)


def test_burst_admits_the_third_request_when_a_seat_frees() -> None:
    """All at 0 with max_num_seqs 2: C waits for steps 1 and 2, then runs step 3 at once."""
    burst = [Work(0.0, w.input_len, w.output_len, w.adapter) for w in WORKS]
    roof = simulate(burst, MODEL, ADAPTERS, LIMITS, PEAKS)
    assert roof.steps == 3 and roof.seconds == pytest.approx(1.1725 + 1.182 + 1.131) == roof.busy_s


def test_steps_follow_the_limits() -> None:
    """Eight 1-token prompts of 5 outputs each: 4 at a time take 5 steps, twice; a token budget of 2 splits the
    prompts of the first step in two steps."""
    works = [Work(0.0, 1, 5, None)] * 8
    assert simulate(works, MODEL, {}, Limits(4, 64), PEAKS).steps == 10
    assert simulate(works, MODEL, {}, Limits(8, 64), PEAKS).steps == 5
    assert simulate(works, MODEL, {}, Limits(8, 2), PEAKS).steps > 5


def test_adapter_bytes_are_read_once_a_step_whatever_its_tokens() -> None:
    one = simulate([Work(0.0, 1, 3, "a"), Work(0.0, 1, 3, "a")], MODEL, ADAPTERS, Limits(2, 8), PEAKS)
    two = simulate([Work(0.0, 1, 3, "a"), Work(0.0, 1, 3, "b")], MODEL, {**ADAPTERS, "b": ADAPTERS["a"]},
                   Limits(2, 8), PEAKS)  # fmt: skip
    assert one.bytes["adapters"] == 3 * 20 and two.bytes["adapters"] == 3 * 40
    assert one.flops["lora"] == two.flops["lora"] == 2 * 3 * 4


@pytest.mark.parametrize(
    ("shape", "parameters"),
    [("llama2-7b", 6_738_415_616), ("llama3-8b", 8_030_261_248), ("qwen2.5-7b", 7_615_616_512)],
)
def test_model_costs_match_the_published_parameter_counts(shape: str, parameters: int, tmp_path: Path) -> None:
    spec = ModelSpec.from_dir(write_model_dir(SHAPES[shape], tmp_path, tokenizer=False))
    cost = ModelCost.from_spec(spec, dtype_bytes=2)
    assert (cost.weight_bytes + 2 * cost.lm_head_bytes) // 2 == parameters  # embedding and LM head untied
    kv_heads, layers = spec.num_kv_heads, spec.num_layers
    assert cost.kv_bytes_per_token == 2 * layers * kv_heads * 128 * 2
    assert cost.attention_flops_per_pair == 4 * layers * spec.num_heads * 128


def test_llama2_step_reads_its_weights_at_the_datasheet_bandwidth(tmp_path: Path) -> None:
    """One decode at batch 1 on Llama-2-7B: 13.21 GB of weights and LM head, 2.75 ms at 4.8 TB/s."""
    spec = ModelSpec.from_dir(write_model_dir(SHAPES["llama2-7b"], tmp_path, tokenizer=False))
    roof = simulate([Work(0.0, 1, 2, None)], ModelCost.from_spec(spec, 2), {}, Limits(256, 2048), roofline.H200_SPEC)
    kv = 2 * 32 * 4096 * 2  # K and V of one position, 32 layers, bf16
    weights = 12_952_543_232 + 262_144_000 + 8192  # layers and final norm, LM head, the token's embedding row
    # prompt: writes its KV; decode at position 1: reads the prompt's KV, writes its own
    assert roof.steps == 2 and roof.seconds == pytest.approx((2 * weights + 3 * kv) / 4.8e12)
    assert roof.seconds == pytest.approx(2 * 2.7533e-3, rel=1e-4)


def test_adapter_elements_from_the_file_equal_those_from_the_setting(tiny_model: Path, tiny_adapters: Path) -> None:
    spec = ModelSpec.from_dir(tiny_model)
    for name in ("s1-0000", "s2-0001", "sall-0003"):
        from_file = roofline.safetensors_elements(tiny_adapters / name / WEIGHTS_FILE)
        assert from_file == roofline.setting_elements(name, spec)
    rank, in_out = SETTINGS["S1"].ranks[0], 2 * (64 + 64)  # q_proj and o_proj 64 x 64; k, v 64 x 32
    assert roofline.setting_elements("s1-0005", spec) == 2 * rank * (in_out + 2 * (64 + 32))
    assert roofline.setting_elements("customer-a", spec) is None


def test_roofline_of_a_trace_and_a_run(tiny_model: Path, tiny_adapters: Path) -> None:
    from perf.workload import TraceConfig, generate_trace

    trace = generate_trace(TraceConfig(num_adapters=6, req_rate=50, duration=0.2, input_range=(4, 9),
                                       output_range=(2, 5), vocab_size=1024, adapter_prefix="s2-"))  # fmt: skip
    setup = roofline.setup_for_model_dir(tiny_model, tiny_adapters, LIMITS, PEAKS)
    roof = roofline.roofline(trace, setup)
    assert roof["num_requests"] == len(trace) and roof["burst"]["seconds"] <= roof["seconds"]
    assert roof["bytes"]["adapters"] > 0 and roof["limits"] == {"max_num_seqs": 2, "max_batch_tokens": 4}
    metrics = roofline.roofline_metrics(trace, setup, duration_s=2 * roof["seconds"])
    assert metrics["roofline_fraction"] == pytest.approx(0.5)
    base = roofline.roofline(trace.with_adapter(None), setup)
    assert base["bytes"]["adapters"] == 0 and base["seconds"] < roof["seconds"]
    unknown = roofline.roofline_metrics(trace.with_adapter("customer-a"), setup, 1.0)
    assert unknown == {"roofline": None, "roofline_fraction": None}
    json.dumps(roof)


def test_peaks_can_be_overridden_with_measured_figures() -> None:
    parser = argparse.ArgumentParser()
    roofline.add_peak_arguments(parser)
    assert roofline.peaks_from_args(parser.parse_args(["--peaks", "h200"])) == roofline.H200_SPEC
    measured = roofline.peaks_from_args(parser.parse_args(["--peaks", "h200-measured"]))
    assert (measured.hbm_bytes_s, measured.flop_s) == (4.23e12, 790e12)
    custom = roofline.peaks_from_args(parser.parse_args(["--hbm-tb-s", "4.1", "--peak-tflops", "700"]))
    assert (custom.hbm_bytes_s, custom.flop_s) == pytest.approx((4.1e12, 700e12)) and "overridden" in custom.source
    with pytest.raises(ValueError, match="flop_s"):
        Peaks(1.0, 0.0, "x")


def test_the_default_peaks_are_those_of_the_gpu_that_runs(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    parser = argparse.ArgumentParser()
    roofline.add_peak_arguments(parser)
    for name, peaks in (("NVIDIA H100 80GB HBM3", roofline.H100_SPEC), ("NVIDIA H200", roofline.H200_SPEC)):
        monkeypatch.setattr(roofline, "gpu_name", lambda name=name: name)
        assert roofline.peaks_from_args(parser.parse_args([])) == peaks
    assert roofline.H100_SPEC.hbm_bytes_s < roofline.H200_SPEC.hbm_bytes_s
    for other in ("NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB", None):
        caplog.clear()
        assert roofline.peaks_of_gpu(other) == roofline.H200_SPEC
        assert "no datasheet peaks" in caplog.text and repr(other) in caplog.text


def test_older_results_get_their_roofline(tiny_model: Path, tiny_adapters: Path, tmp_path: Path) -> None:
    """python -m perf.roofline --results: each run without a roofline gets one, under its own engine's limits."""
    from perf.results import append_runs, load_results, make_run
    from perf.workload import TraceConfig, generate_trace, save_trace

    config = TraceConfig(num_adapters=3, req_rate=50, duration=0.2, input_range=(4, 9), output_range=(2, 5),
                         vocab_size=1024)  # fmt: skip
    trace_path = save_trace(generate_trace(config), tmp_path / "s1-n3.jsonl")
    trace = {"path": str(trace_path), "config": {"num_adapters": 3, "adapter_prefix": "s1-"}}
    metrics = {"duration_s": 1.0}
    engine = {"mode": "lora", "engine": {"config": {"max_num_seqs": 3, "max_batch_tokens": 16}}}
    runs = [
        make_run("e", "engine", trace, engine, dict(metrics)),
        make_run("s", "serving", trace, {"mode": "base"}, dict(metrics)),
        make_run("p", "peft", trace, {}, dict(metrics)),
    ]
    runs[1]["env"]["device"] = "NVIDIA H100 80GB HBM3"  # made on another machine than the one annotating
    results = tmp_path / "results.json"
    append_runs(results, runs)
    roofline.main(["--model", str(tiny_model), "--adapter-root", str(tiny_adapters), "--results", str(results)])
    stored = {run["name"]: run["metrics"] for run in load_results(results)["runs"]}
    assert stored["e"]["roofline"]["limits"] == {"max_num_seqs": 3, "max_batch_tokens": 16}
    served = stored["s"]["roofline"]
    assert served["limits"] == asdict(Limits.engine_defaults()) and served["bytes"]["adapters"] == 0
    assert stored["e"]["roofline_fraction"] == pytest.approx(stored["e"]["roofline"]["seconds"])
    assert "roofline" not in stored["p"], "PEFT runs have no engine limits to model"
    assert served["peaks"]["source"] == roofline.H100_SPEC.source  # the GPU the run recorded, not this machine's
