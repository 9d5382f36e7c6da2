"""bench_serving's requests, response decoding and replay, against an in-process fake of tritonclient's stream.

The fake server streams one token per response, as the `slora` model does (or one word of text for the
`ensemble`, echoing the prompt first), so the whole client path runs without Triton.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from perf import bench_serving
from perf.bench_engine import RunSpec
from perf.make_model import ids_to_text
from perf.triton_protocol import ModelIO, StreamState, Target, decode, encode
from perf.workload import TraceConfig, TraceRequest, generate_trace, save_trace
from slora.client.engine_limits import parse_limits


class FakeInput:
    def __init__(self, name: str, shape: list[int], datatype: str) -> None:
        self.name, self.shape, self.datatype = name, shape, datatype
        self.data: np.ndarray | None = None

    def set_data_from_numpy(self, array: np.ndarray) -> None:
        assert list(array.shape) == self.shape
        self.data = array


class FakeParam:
    def __init__(self, value: bool) -> None:
        self.bool_param = value


class FakeResponse:
    def __init__(self, rid: str, final: bool) -> None:
        self.id = rid
        self.parameters = {"triton_final_response": FakeParam(final)}


class FakeResult:
    def __init__(self, rid: str, outputs: dict[str, np.ndarray], final: bool) -> None:
        self._outputs, self._response = outputs, FakeResponse(rid, final)

    def as_numpy(self, name: str) -> np.ndarray | None:
        return self._outputs.get(name)

    def get_response(self) -> FakeResponse:
        return self._response


class FakeClient:
    infer_input = FakeInput

    def __init__(self, io: ModelIO, text: bool = False, fail_adapter: str | None = None) -> None:
        self.io, self.text, self.fail_adapter = io, text, fail_adapter
        self.seen: list[dict[str, Any]] = []

    async def model_io(self, model: str) -> ModelIO:
        return self.io

    def stream_infer(self, iterator: Any) -> Any:
        return self._stream(iterator)

    async def _stream(self, iterator: Any) -> Any:
        out: asyncio.Queue = asyncio.Queue()

        async def consume() -> None:
            async for request in iterator:
                self.seen.append(request)
                asyncio.get_running_loop().create_task(self._generate(request, out))

        consumer = asyncio.get_running_loop().create_task(consume())
        try:
            while True:
                yield await out.get()
        finally:
            consumer.cancel()

    async def _generate(self, request: dict[str, Any], out: asyncio.Queue) -> None:
        tensors = {t.name: t.data for t in request["inputs"]}
        sampling = json.loads(tensors["sampling_parameters"][0])
        adapter = tensors.get("adapter_id", [b""])[0].decode() or sampling.get("lora_name")
        rid = request["request_id"]
        if adapter and adapter == self.fail_adapter:
            out.put_nowait((None, RuntimeError(f"adapter {adapter!r} not found")))
            return
        prompt = tensors["text_input"][0].decode() if self.text else ""
        for i in range(sampling["max_tokens"]):
            await asyncio.sleep(0.001)
            last = i == sampling["max_tokens"] - 1
            if self.text:
                word = (prompt + " " if i == 0 else " ") + f"t{i + 3}"
                outputs = {"text_output": np.asarray([word.encode()], dtype=np.object_)}
            else:
                outputs = {"output_ids": np.asarray([i + 3], dtype=np.int32)}
            outputs["finish_reason"] = np.asarray([b"length" if last else b""], dtype=np.object_)
            out.put_nowait((FakeResult(rid, outputs, final=last), None))


REQUEST = TraceRequest(7, 0.0, "s1-0003", (5, 6, 7), 4)


def test_encode_token_model_with_declared_inputs_only() -> None:
    io = ModelIO(frozenset({"input_ids", "adapter_id", "sampling_parameters", "stream"}), batched=True)
    request = encode(REQUEST, "r7", Target.named("slora"), io, FakeInput)
    tensors = {t.name: t for t in request["inputs"]}
    assert set(tensors) == {"input_ids", "adapter_id", "sampling_parameters", "stream"}  # no max_tokens input
    assert tensors["input_ids"].shape == [1, 3] and tensors["input_ids"].datatype == "INT32"
    assert tensors["adapter_id"].data.tolist() == [[b"s1-0003"]]
    assert json.loads(tensors["sampling_parameters"].data[0][0]) == {
        "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
    }  # fmt: skip
    assert request["request_id"] == "r7" and request["parameters"] is None


def test_encode_ensemble_sends_text_and_lora_name() -> None:
    io = ModelIO(frozenset({"text_input", "stream", "sampling_parameters", "exclude_input_in_output",
                            "return_num_output_tokens"}))  # fmt: skip
    request = encode(REQUEST, "r7", Target.named("ensemble"), io, FakeInput, ids_to_text, max_tokens=1)
    tensors = {t.name: t for t in request["inputs"]}
    assert tensors["text_input"].data.tolist() == [b"t5 t6 t7"]
    assert tensors["stream"].datatype == "BOOL" and tensors["exclude_input_in_output"].data.tolist() == [True]
    assert tensors["return_num_output_tokens"].data.tolist() == [True]
    sampling = json.loads(tensors["sampling_parameters"].data[0])
    assert sampling["max_tokens"] == 1 and sampling["lora_name"] == "s1-0003" and request["parameters"] is None
    parameter_route = Target("ensemble", "text", "parameter", "lora_name")
    request = encode(REQUEST, "r7", parameter_route, ModelIO(), FakeInput, ids_to_text)
    assert request["parameters"] == {"lora_name": "s1-0003"}
    assert "exclude_input_in_output" not in {t.name for t in request["inputs"]}  # not declared: not sent


def test_decode_text_strips_echo_and_handles_cumulative_text() -> None:
    target = Target.named("ensemble")
    state = StreamState(expected_tokens=3, prompt_text="t5 t6")

    def text(s: str) -> FakeResult:
        return FakeResult("r", {"text_output": np.asarray([s.encode()], dtype=np.object_)}, final=False)

    assert decode(text("t5 t6 t9"), target, state, lambda s: len(s.split())).num_tokens == 1
    assert decode(text(" t10"), target, state, lambda s: len(s.split())).num_tokens == 1
    assert decode(text(" t9 t10 t11"), target, state, lambda s: len(s.split())).num_tokens == 1  # cumulative
    assert state.tokens == 3 and state.text == " t9 t10 t11"
    counted = FakeResult("r", {"text_output": np.asarray([b" x"], dtype=np.object_),
                               "num_output_tokens": np.asarray([2], dtype=np.uint32)}, final=False)  # fmt: skip
    assert decode(counted, target, state, lambda s: 99).num_tokens == 2


@pytest.mark.parametrize("target_name", ["slora", "ensemble"])
def test_replay_records_every_token(target_name: str, tmp_path: Path) -> None:
    config = TraceConfig(num_adapters=4, req_rate=200, duration=0.1, input_range=(4, 8), output_range=(2, 6),
                         vocab_size=100)  # fmt: skip
    trace_path = save_trace(generate_trace(config), tmp_path / "t.jsonl")
    client = FakeClient(ModelIO(), text=target_name == "ensemble")
    options = bench_serving.ServingOptions(streams=2, warmup_requests=2, progress_interval_s=0.2)
    text_of, count = bench_serving.load_tokenizer(None)
    run = asyncio.run(bench_serving.run_one(client, RunSpec(trace_path), Target.named(target_name), options,
                                            "fake", text_of, count))  # fmt: skip
    m = run["metrics"]
    assert run["kind"] == "serving" and m["num_requests"] == 20
    assert m["num_finished"] == 20 and m["num_short"] == 0 and m["stream_errors"] == 0
    assert m["ttft_s"]["p50"] > 0 and m["throughput_rps"] > 0
    adapters = {r.adapter for r in generate_trace(config).requests}
    assert len(client.seen) == len(adapters) + 2 + 20  # preload one per adapter, warm-up, the trace


def test_replay_gives_up_on_requests_that_never_end(tmp_path: Path) -> None:
    config = TraceConfig(num_adapters=2, req_rate=100, duration=0.1, input_range=(4, 8), output_range=(2, 4),
                         vocab_size=100)  # fmt: skip
    trace = generate_trace(config)
    bad = trace.adapters()[0]
    client = FakeClient(ModelIO(), fail_adapter=bad)
    options = bench_serving.ServingOptions(idle_timeout_s=30, progress_interval_s=0.2)  # ends without waiting
    replay = bench_serving.StreamReplay(client, Target.named("slora"), ModelIO(), list(trace.requests), options,
                                        None, len)  # fmt: skip
    began = time.perf_counter()
    asyncio.run(replay.run())
    assert time.perf_counter() - began < 10
    failed = [r for r in trace.requests if r.adapter == bad]
    assert len(replay.stream_errors) == len(failed)
    assert len(replay.open) == len(failed)  # errors without a request id cannot be attributed
    assert all(replay.records[f"r{r.index}"].ok for r in trace.requests if r.adapter != bad)


def test_headline_traces_are_long_saturating_and_ordered(tmp_path: Path) -> None:
    recipe = bench_serving.Headline(num_adapters=(5, 2000), rate=50.0, duration_s=60.0)
    runs = recipe.runs(tmp_path, vocab_size=1024)
    assert [(r.trace_path.name, r.mode) for r in runs] == [
        ("s1-n2000-50rps-60s.jsonl", "lora"), ("s1-n5-50rps-60s.jsonl", "lora"), ("s1-n2000-50rps-60s.jsonl", "base"),
    ]  # fmt: skip
    trace = runs[0].load()
    assert len(trace) == 3000 and trace.config.duration == 60.0 and trace.config.vocab_size == 1024
    assert runs[1].load().requests[7].arrival == trace.requests[7].arrival  # one seed: the same arrivals
    assert runs[2].load().adapters() == []
    with pytest.raises(ValueError, match="duration_s must be >= 60"):
        bench_serving.Headline(duration_s=30.0)
    assert bench_serving.Headline(duration_s=1.0, allow_short=True).duration_s == 1.0
    with pytest.raises(ValueError, match="setting"):
        bench_serving.Headline(setting="S9")


def test_served_setup_reads_the_servers_parameters(tiny_model: Path, tiny_adapters: Path) -> None:
    config = {"config": {"parameters": {"model": {"string_value": str(tiny_model)},
                                        "adapter_root": {"string_value": str(tiny_adapters)},
                                        "max_num_seqs": {"string_value": "64"},
                                        "device": {"string_value": "cuda"}}}}  # fmt: skip
    parameters = bench_serving.parameters_of(config)
    peaks = bench_serving.roofline.H200_SPEC
    setup = bench_serving.served_setup(parameters, bench_serving.RooflineOverrides(), peaks)
    assert setup is not None and setup.dtype_bytes == 2 and setup.spec.hidden_size == 64
    assert (setup.limits.max_num_seqs, setup.limits.max_batch_tokens) == (64, 2048)
    assert setup.locate("s1-0001") == tiny_adapters / "s1-0001"
    overrides = bench_serving.RooflineOverrides(max_num_seqs=8, dtype_bytes=4)
    overridden = bench_serving.served_setup(parameters, overrides, peaks)
    assert overridden is not None and (overridden.limits.max_num_seqs, overridden.dtype_bytes) == (8, 4)
    elsewhere = {"model": "/no/such/model"}
    assert bench_serving.served_setup(elsewhere, bench_serving.RooflineOverrides(), peaks) is None
    assert bench_serving.served_dtype_bytes({"device": "cpu"}) == 4


def test_served_setup_takes_the_limits_the_engine_resolved(tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A server whose parameters leave the batch limits "auto": the roofline takes the engine's own (its metrics
    page), a number among the parameters before them and an override before both; with neither, the CPU defaults,
    logged as an assumption."""
    peaks = bench_serving.roofline.H200_SPEC
    page = 'slora_engine_limit{limit="max_num_seqs"} 512\nslora_engine_limit{limit="max_batch_tokens"} 2048.0\n'
    resolved = parse_limits(page + "slora_max_running_requests 512\n")
    assert resolved == {"max_num_seqs": 512, "max_batch_tokens": 2048}
    auto = {"model": str(tiny_model), "max_num_seqs": "auto"}
    setup = bench_serving.served_setup(auto, bench_serving.RooflineOverrides(), peaks, resolved)
    assert setup is not None and (setup.limits.max_num_seqs, setup.limits.max_batch_tokens) == (512, 2048)
    overrides = bench_serving.RooflineOverrides(max_batch_tokens=4096)
    given = bench_serving.served_setup({**auto, "max_num_seqs": "96"}, overrides, peaks, resolved)
    assert given is not None and (given.limits.max_num_seqs, given.limits.max_batch_tokens) == (96, 4096)
    with caplog.at_level(logging.WARNING, logger=bench_serving.__name__):
        unknown = bench_serving.served_setup(auto, bench_serving.RooflineOverrides(), peaks)
    assert unknown is not None and unknown.limits == bench_serving.roofline.Limits.engine_defaults()
    assert "max_num_seqs" in caplog.text and "max_batch_tokens" in caplog.text and "CPU default" in caplog.text
    assert bench_serving.served_limits(None) == {}


def test_sweep_measures_at_fractions_of_the_capacity(tiny_model: Path, tiny_adapters: Path, tmp_path: Path) -> None:
    """The fake server keeps up with any rate, so the capacity run does not saturate (and says so); the load runs
    replay the same trace settings at 50% and 80% of what it measured, each with its roofline."""
    config = TraceConfig(num_adapters=4, req_rate=100, duration=0.2, input_range=(4, 8), output_range=(2, 6),
                         vocab_size=1024)  # fmt: skip
    spec = RunSpec(save_trace(generate_trace(config), tmp_path / "t.jsonl"))
    setup = bench_serving.served_setup({"model": str(tiny_model), "adapter_root": str(tiny_adapters)},
                                       bench_serving.RooflineOverrides(), bench_serving.roofline.H200_SPEC)  # fmt: skip
    text_of, count = bench_serving.load_tokenizer(None)
    options = bench_serving.ServingOptions(warmup_requests=1, progress_interval_s=0.2)
    out = tmp_path / "results.json"
    session = bench_serving.Session(FakeClient(ModelIO()), Target.named("slora"), options, text_of, count, "srv", out,
                                    setup)  # fmt: skip
    runs = asyncio.run(session.sweep(spec, (0.5, 0.8), tmp_path / "traces"))
    first, *loads = runs
    capacity = first["sweep"]["capacity_rps"]
    assert first["sweep"]["role"] == "capacity" and first["sweep"]["saturated"] is False and capacity > 0
    assert [r["sweep"]["load_fraction"] for r in loads] == [0.5, 0.8]
    assert [r["trace"]["config"]["req_rate"] for r in loads] == [round(f * capacity, 3) for f in (0.5, 0.8)]
    assert [r["name"] for r in loads] == ["srv-slora-t-at50-lora", "srv-slora-t-at80-lora"]
    assert all(r["metrics"]["num_finished"] == r["metrics"]["num_requests"] for r in runs)
    assert all(0 < r["metrics"]["roofline_fraction"] < 1 for r in runs)
    stored = json.loads(out.read_text())["runs"]
    assert [r["sweep"]["role"] for r in stored] == ["capacity", "load", "load"]


def test_command_line_needs_runs_or_the_headline() -> None:
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--out", "r.json"])
    for bad in (["--clients", "0"], ["--clients", "2", "--target", "ensemble"]):  # several replay token ids only
        with pytest.raises(SystemExit):
            bench_serving.parse_args(["--headline", "--out", "r.json", *bad])
    assert bench_serving.parse_args(["--headline", "--out", "r.json", "--clients", "3"]).clients == 3
    args = bench_serving.parse_args(["--headline", "--sweep", "--out", "r.json", "--peaks", "h200-measured"])
    assert args.duration == 120.0 and args.loads == [0.5, 0.8] and args.num_adapters == [2000, 5]
