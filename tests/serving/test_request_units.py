"""Request decoding and response building of the served model, without a server (fast)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from slora.backend.engine.detokenizer import TextSpan
from slora.backend.engine.outputs import RequestOutput
from slora.backend.errors import InvalidRequestError
from slora.backend.serving import drain
from slora.backend.serving.options import ServingOptions, model_config_parameters
from slora.backend.serving.request_inputs import RawRequest, parse_adapter_command, parse_generate
from slora.backend.serving.response_stream import OUTPUT_NAMES, ResponseStream


def _raw(parameters: dict | None = None, **tensors: object) -> RawRequest:
    arrays = {}
    for name, value in tensors.items():
        if isinstance(value, str):
            arrays[name] = np.asarray([value.encode()], dtype=np.object_)
        elif isinstance(value, bool):
            arrays[name] = np.asarray([value])
        elif isinstance(value, int):
            arrays[name] = np.asarray([value], dtype=np.int32)
        else:
            arrays[name] = np.asarray(value)
    return RawRequest(arrays, parameters or {})


IDS = np.asarray([5, 6, 7], dtype=np.int32)


def test_defaults_and_every_adapter_source() -> None:
    inputs = parse_generate(_raw(input_ids=IDS))
    assert (inputs.prompt_ids, inputs.adapter, inputs.stream) == ([5, 6, 7], None, False)
    assert inputs.sampling.max_tokens == 16
    assert parse_generate(_raw(input_ids=IDS, adapter_id="a")).adapter == "a"
    assert parse_generate(_raw({"lora_name": "b"}, input_ids=IDS)).adapter == "b"
    assert parse_generate(_raw({"adapter_id": "c"}, input_ids=IDS)).adapter == "c"
    assert parse_generate(_raw(input_ids=IDS, sampling_parameters='{"lora_name": "d"}')).adapter == "d"
    assert parse_generate(_raw({"lora_name": "e"}, input_ids=IDS, adapter_id="e")).adapter == "e"
    assert parse_generate(_raw(input_ids=IDS, adapter_id="")).adapter is None
    with pytest.raises(InvalidRequestError, match="two different adapters.*'a'.*'b'"):
        parse_generate(_raw({"lora_name": "b"}, input_ids=IDS, adapter_id="a"))


def test_text_spans_only_for_the_ensemble() -> None:
    """The preprocessing step always sends prefix_text; direct token-id calls get no text, so none is decoded."""
    assert not parse_generate(_raw(input_ids=IDS)).wants_text
    assert parse_generate(_raw(input_ids=IDS, prefix_text="")).wants_text


def test_sampling_merges_parameters_json_and_inputs() -> None:
    inputs = parse_generate(
        _raw({"temperature": 0, "triton_enable_empty_final_response": True, "apply_chat_template": True},
             input_ids=IDS, max_tokens=9, stream=True, sampling_parameters='{"top_k": 3, "stop": ["x"]}')
    )  # fmt: skip
    sampling = inputs.sampling
    assert (sampling.temperature, sampling.top_k, sampling.max_tokens, sampling.stop) == (0.0, 3, 9, ("x",))
    assert inputs.stream
    with pytest.raises(InvalidRequestError, match="'max_tokens' is given twice with different values: 5 and 9"):
        parse_generate(_raw(input_ids=IDS, max_tokens=9, sampling_parameters='{"max_tokens": 5}'))
    assert parse_generate(_raw(input_ids=IDS), default_max_tokens=40).sampling.max_tokens == 40


def test_vllm_client_habits_are_accepted() -> None:
    text = json.dumps({"max_tokens": "12", "min_tokens": "12", "temperature": "0.5", "logprobs": False, "n": 1})
    sampling = parse_generate(_raw(input_ids=IDS, sampling_parameters=text)).sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.ignore_eos) == (12, 0.5, True)
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        parse_generate(_raw(input_ids=IDS, sampling_parameters='{"max_tokens": 12, "min_tokens": 3}'))


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({}, "input 'input_ids' .* is required"),
        ({"input_ids": np.asarray([[1, 2]], dtype=np.int32)}, "must be 1-D"),
        ({"input_ids": IDS, "sampling_parameters": "{nope"}, "is not valid JSON"),
        ({"input_ids": IDS, "sampling_parameters": '"text"'}, "must be a JSON object, got str"),
        ({"input_ids": IDS, "sampling_parameters": '{"temperature": "hot"}'}, "'temperature' must be a finite"),
        ({"input_ids": IDS, "max_tokens": np.asarray([1, 2], dtype=np.int32)}, "'max_tokens' must hold exactly one"),
        ({"input_ids": IDS, "adapter_id": np.asarray([b"\xff"], dtype=np.object_)}, "not valid UTF-8"),
    ],
)
def test_bad_requests_name_the_input(tensors: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        parse_generate(_raw(**tensors))


def test_adapter_commands() -> None:
    command = parse_adapter_command(_raw(adapter_command="load", adapter_id="x", adapter_path="/a/x"))
    assert (command.op, command.name, command.path) == ("load", "x", "/a/x")
    assert parse_adapter_command(_raw(adapter_command="LIST")).op == "list"
    with pytest.raises(InvalidRequestError, match="one of list, load, unload, got 'drop'"):
        parse_adapter_command(_raw(adapter_command="drop"))
    with pytest.raises(InvalidRequestError, match="'unload' needs the adapter name"):
        parse_adapter_command(_raw(adapter_command="unload"))


def _output(tokens: list[int], span: TextSpan | None, reason: str | None = None) -> RequestOutput:
    return RequestOutput("r", tokens, "", span, reason is not None, reason, num_prompt_tokens=3)


def test_streamed_responses_carry_tokens_spans_and_the_prefix_once() -> None:
    stream = ResponseStream(stream=True, arrival=0.0, prefix_text="P")
    first = stream.add(_output([10], TextSpan([1, 10], 2, 3)), at=0.5)
    second = stream.add(_output([11], None), at=0.7)
    last = stream.add(_output([12], TextSpan([10, 11, 12], 4, 5), "length"), at=1.0)
    assert first is not None and second is not None and last is not None
    assert set(first.arrays) == set(OUTPUT_NAMES) and not first.final and last.final
    assert first.arrays["prefix_text"].tolist() == [b"P"] and last.arrays["prefix_text"].tolist() == [b""]
    assert second.arrays["text_spans"].shape == (0, 3) and second.arrays["text_span_ids"].size == 0
    assert last.arrays["text_spans"].tolist() == [[3, 4, 5]] and last.arrays["finish_reason"].tolist() == [b"length"]
    assert [k for k, _ in stream.latencies] == ["ttft", "itl", "itl"]
    assert stream.latencies[0][1] == pytest.approx(0.5) and stream.latencies[2][1] == pytest.approx(0.3)


def test_unstreamed_request_gets_one_response_with_every_span() -> None:
    stream = ResponseStream(stream=False, arrival=0.0)
    assert stream.add(_output([10], TextSpan([10], 0, 2)), at=0.1) is None
    reply = stream.add(_output([11], TextSpan([10, 11], 2, 3), "stop"), at=0.2)
    assert reply is not None and reply.final
    assert reply.arrays["output_ids"].tolist() == [10, 11]
    assert reply.arrays["text_span_ids"].tolist() == [10, 10, 11]
    assert reply.arrays["text_spans"].tolist() == [[1, 0, 2], [2, 2, 3]]
    assert reply.arrays["num_output_tokens"].tolist() == [2] and reply.arrays["num_input_tokens"].tolist() == [3]


def test_queued_outputs_of_a_stream_merge_into_one_response() -> None:
    """Outputs that queued up while the responder was busy: one response, every token, per-token latencies."""
    stream = ResponseStream(stream=True, arrival=0.0, prefix_text="P")
    reply = stream.add_many([(_output([10], TextSpan([10], 0, 2)), 0.5), (_output([11], None), 0.6),
                             (_output([12], TextSpan([11, 12], 2, 3)), 0.8)])  # fmt: skip
    assert reply is not None and not reply.final
    assert reply.arrays["output_ids"].tolist() == [10, 11, 12] and reply.arrays["num_output_tokens"].tolist() == [3]
    assert reply.arrays["text_span_ids"].tolist() == [10, 11, 12]
    assert reply.arrays["text_spans"].tolist() == [[1, 0, 2], [2, 2, 3]]
    assert reply.arrays["prefix_text"].tolist() == [b"P"]
    assert [k for k, _ in stream.latencies] == ["ttft", "itl", "itl"]
    assert stream.latencies[2][1] == pytest.approx(0.2)
    last = stream.add_many([(_output([13], None), 0.9), (_output([14], None, "length"), 1.0)])
    assert last is not None and last.final and last.arrays["output_ids"].tolist() == [13, 14]
    assert last.arrays["finish_reason"].tolist() == [b"length"] and last.arrays["prefix_text"].tolist() == [b""]


def test_only_the_requested_outputs_are_built() -> None:
    stream = ResponseStream(stream=True, arrival=0.0, outputs=frozenset({"output_ids", "finish_reason"}))
    reply = stream.add(_output([10], TextSpan([10], 0, 2), "stop"), at=0.1)
    assert reply is not None and set(reply.arrays) == {"output_ids", "finish_reason"}
    spans_only = ResponseStream(stream=True, arrival=0.0, outputs=frozenset({"text_spans"}))
    reply = spans_only.add(_output([10], TextSpan([10], 0, 2)), at=0.1)
    assert (
        reply is not None and set(reply.arrays) == {"text_spans"} and reply.arrays["text_spans"].tolist() == [[1, 0, 2]]
    )


def test_serving_options_split_engine_and_serving_keys(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "multi_lora.json").write_text("{}")
    parameters = model_config_parameters(
        {"parameters": {"model": {"string_value": "/m"}, "max_num_seqs": {"string_value": "8"},
                        "lora_info_metric": {"string_value": "true"}, "default_max_tokens": {"string_value": "32"},
                        "pool_bytes": {"string_value": ""}, "drain_file": {"string_value": "/ws/drain"}}}
    )  # fmt: skip
    options = ServingOptions.from_parameters(parameters, tmp_path)
    assert (options.engine.model, options.engine.max_num_seqs, options.engine.pool_bytes) == ("/m", 8, None)
    assert options.lora_info_metric and options.default_max_tokens == 32 and options.drain_file == "/ws/drain"
    assert options.engine.adapter_registry == str(tmp_path / "multi_lora.json")
    with pytest.raises(ValueError, match="unknown engine option 'max_batch'"):
        ServingOptions.from_parameters({"max_batch": "4"})
    with pytest.raises(ValueError, match="adapter_admin must be true or false"):
        ServingOptions.from_parameters({"adapter_admin": "maybe"})


class _InFlight:
    """Requests for the drain watcher; the first abort misses them (they were being submitted as it began)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.aborts = 0

    def in_flight(self) -> int:
        return self.count

    def abort_all(self) -> int:
        self.aborts += 1
        if self.aborts > 1:
            self.count = 0
        return self.count


def test_drain_ends_every_request_in_flight_then_acknowledges(tmp_path: Path) -> None:
    drain_file = tmp_path / "drain"
    requests = _InFlight(2)
    watcher = drain.DrainWatcher(drain_file, requests, poll_s=0.01)
    try:
        time.sleep(0.05)
        assert not watcher.draining and requests.aborts == 0
        drain_file.touch()
        deadline = time.monotonic() + 5.0
        while not drain.done_file(drain_file).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watcher.draining and requests.aborts == 2 and requests.count == 0
        assert drain.done_file(drain_file).exists()
    finally:
        watcher.close()
    drain.clear(drain_file)  # what slora-serve does before it starts a server in a reused workspace
    assert not drain_file.exists() and not drain.done_file(drain_file).exists()
