"""Request decoding and response building of the served model, without a server (fast)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from slora.backend.engine.outputs import RequestOutput
from slora.backend.errors import InvalidRequestError
from slora.backend.serving import drain
from slora.backend.serving.admin_guard import AdminGuard, read_token
from slora.backend.serving.options import ServingOptions, model_config_parameters
from slora.backend.serving.prompt import PromptEncoder
from slora.backend.serving.request_inputs import RawRequest, admin_token, parse_adapter_command, parse_generate
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


def test_text_prompts_are_tokenized_once_here(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """text_input is encoded as the engine encodes a string (or through the chat template); input_ids pass as they
    are; the prompt is echoed before the output as the vLLM backend does (unstreamed: unless excluded)."""
    encoder = PromptEncoder(tokenizer)
    inputs = parse_generate(_raw(text_input="Hello there"), encoder)
    assert inputs.is_text and inputs.prompt_ids == tokenizer.encode("Hello there", add_special_tokens=True)
    assert inputs.echo == "Hello there"
    assert parse_generate(_raw(text_input="Hi", stream=True), encoder).echo == ""
    assert parse_generate(_raw(text_input="Hi", exclude_input_in_output=True), encoder).echo == ""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    chat = parse_generate(_raw({"apply_chat_template": "true"}, text_input="Hi"), encoder)
    assert chat.prompt_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert parse_generate(_raw(text_input="Hi"), PromptEncoder(tokenizer, chat_template=True)).prompt_ids == (
        chat.prompt_ids
    )
    plain = parse_generate(_raw({"add_special_tokens": False}, text_input="Hi"), encoder)
    assert plain.prompt_ids == tokenizer.encode("Hi", add_special_tokens=False)
    tokens = parse_generate(_raw(input_ids=IDS), encoder)
    assert not tokens.is_text and tokens.echo == "" and tokens.prompt_ids == [5, 6, 7]
    with pytest.raises(InvalidRequestError, match="exclude_input_in_output=false is not supported with stream"):
        parse_generate(_raw(text_input="Hi", stream=True, exclude_input_in_output=False), encoder)
    with pytest.raises(InvalidRequestError, match="'text_input' or as 'input_ids', not both"):
        parse_generate(_raw(text_input="Hi", input_ids=IDS), encoder)


def test_a_server_without_tokenizer_says_how_to_serve_text() -> None:
    with pytest.raises(InvalidRequestError, match="no tokenizer.*input_ids.*--tokenizer PATH"):
        parse_generate(_raw(text_input="Hello"), PromptEncoder(None))
    assert parse_generate(_raw(input_ids=IDS), PromptEncoder(None)).prompt_ids == [5, 6, 7]


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
        ({}, "the prompt is missing: give input 'text_input' .* or 'input_ids'"),
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
    with pytest.raises(InvalidRequestError, match="one of list, load, unload, tenant_weights, got 'drop'"):
        parse_adapter_command(_raw(adapter_command="drop"))
    with pytest.raises(InvalidRequestError, match="'unload' needs the adapter name"):
        parse_adapter_command(_raw(adapter_command="unload"))


def _output(tokens: list[int], text: str, reason: str | None = None) -> RequestOutput:
    return RequestOutput("r", tokens, text, reason is not None, reason, num_prompt_tokens=3)


def test_streamed_responses_carry_tokens_text_and_the_echo_once() -> None:
    stream = ResponseStream(stream=True, arrival=0.0, echo="P")
    first = stream.add(_output([10], "ab"), at=0.5)
    second = stream.add(_output([11], ""), at=0.7)
    last = stream.add(_output([12], "cd", "length"), at=1.0)
    assert first is not None and second is not None and last is not None
    assert set(first.arrays) == set(OUTPUT_NAMES) and not first.final and last.final
    assert first.arrays["text_output"].tolist() == [b"Pab"] and second.arrays["text_output"].tolist() == [b""]
    assert last.arrays["text_output"].tolist() == [b"cd"] and last.arrays["finish_reason"].tolist() == [b"length"]
    assert [k for k, _ in stream.latencies] == ["ttft", "itl", "itl"]
    assert stream.latencies[0][1] == pytest.approx(0.5) and stream.latencies[2][1] == pytest.approx(0.3)


def test_unstreamed_request_gets_one_response_with_the_whole_text() -> None:
    stream = ResponseStream(stream=False, arrival=0.0, echo="Say: ")
    assert stream.add(_output([10], "Hé"), at=0.1) is None
    reply = stream.add(_output([11], "llo", "stop"), at=0.2)
    assert reply is not None and reply.final
    assert reply.arrays["output_ids"].tolist() == [10, 11]
    assert reply.arrays["text_output"].tolist() == ["Say: Héllo".encode()]
    assert reply.arrays["num_output_tokens"].tolist() == [2] and reply.arrays["num_input_tokens"].tolist() == [3]


def test_queued_outputs_of_a_stream_merge_into_one_response() -> None:
    """Outputs that queued up while the responder was busy: one response, every token, per-token latencies."""
    stream = ResponseStream(stream=True, arrival=0.0, echo="P")
    reply = stream.add_many([(_output([10], "a"), 0.5), (_output([11], ""), 0.6), (_output([12], "bc"), 0.8)])
    assert reply is not None and not reply.final
    assert reply.arrays["output_ids"].tolist() == [10, 11, 12] and reply.arrays["num_output_tokens"].tolist() == [3]
    assert reply.arrays["text_output"].tolist() == [b"Pabc"]
    assert [k for k, _ in stream.latencies] == ["ttft", "itl", "itl"]
    assert stream.latencies[2][1] == pytest.approx(0.2)
    last = stream.add_many([(_output([13], "d"), 0.9), (_output([14], "", "length"), 1.0)])
    assert last is not None and last.final and last.arrays["output_ids"].tolist() == [13, 14]
    assert last.arrays["finish_reason"].tolist() == [b"length"] and last.arrays["text_output"].tolist() == [b"d"]


def test_only_the_requested_outputs_are_built() -> None:
    stream = ResponseStream(stream=True, arrival=0.0, outputs=frozenset({"output_ids", "finish_reason"}))
    reply = stream.add(_output([10], "ab", "stop"), at=0.1)
    assert reply is not None and set(reply.arrays) == {"output_ids", "finish_reason"}
    text_only = ResponseStream(stream=True, arrival=0.0, outputs=frozenset({"text_output"}))
    reply = text_only.add(_output([10], "ab"), at=0.1)
    assert (
        reply is not None and set(reply.arrays) == {"text_output"} and reply.arrays["text_output"].tolist() == [b"ab"]
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


def test_the_drain_waits_for_every_peer_that_joined(tmp_path: Path) -> None:
    drain_file = tmp_path / "drain"
    drain.join(drain_file, "ensemble")
    engine, peer = _InFlight(1), _InFlight(3)
    watchers = [drain.DrainWatcher(drain_file, engine, poll_s=0.01),
                drain.DrainWatcher(drain_file, peer, poll_s=0.01, peer="ensemble")]  # fmt: skip
    try:
        assert drain.peers(drain_file) == ["ensemble"] and not drain.all_done(drain_file)
        drain_file.touch()
        deadline = time.monotonic() + 5.0
        while not drain.all_done(drain_file) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert drain.all_done(drain_file) and engine.count == 0 and peer.count == 0
        assert drain.done_file(drain_file, "ensemble").exists()
    finally:
        for watcher in watchers:
            watcher.close()
    drain.done_file(drain_file, "ensemble").unlink()
    assert not drain.all_done(drain_file)  # a peer that joined and has not acknowledged holds the stop
    drain.leave(drain_file, "ensemble")
    assert drain.all_done(drain_file)  # one that left (its model unloaded) does not
    drain.join(drain_file, "ensemble")
    drain.clear(drain_file)
    assert not list(tmp_path.iterdir())


def test_scheduling_fields_come_from_parameters_or_sampling_and_never_reach_sampling() -> None:
    inputs = parse_generate(_raw({"tenant": "acme", "priority": "3"}, input_ids=IDS,
                                 sampling_parameters='{"ttft_slo_s": "2.5", "temperature": 0}'))  # fmt: skip
    assert inputs.scheduling.tenant == "acme" and inputs.scheduling.priority == 3
    assert inputs.scheduling.ttft_slo_s == 2.5 and inputs.sampling.temperature == 0
    assert parse_generate(_raw(input_ids=IDS)).scheduling.tenant is None
    with pytest.raises(InvalidRequestError, match="'tenant' is given twice"):
        parse_generate(_raw({"tenant": "a"}, input_ids=IDS, sampling_parameters='{"tenant": "b"}'))


def test_deeply_nested_sampling_json_is_the_clients_error() -> None:
    nested = "[" * 100_000 + "]" * 100_000
    with pytest.raises(InvalidRequestError, match="'sampling_parameters' is nested too deeply"):
        parse_generate(_raw(input_ids=IDS, sampling_parameters=nested))
    with pytest.raises(InvalidRequestError, match="must be a JSON object, got list"):
        parse_generate(_raw(input_ids=IDS, sampling_parameters="[[1]]"))


def test_admin_commands_carry_replace_token_and_tenant_weights() -> None:
    raw = _raw({"replace": "true"}, adapter_command="load", adapter_id="a", adapter_path="/x")
    command = parse_adapter_command(raw)
    assert (command.op, command.name, command.path, command.replace) == ("load", "a", "/x", True)
    assert not parse_adapter_command(_raw(adapter_command="load", adapter_id="a")).replace
    weights = parse_adapter_command(_raw({"tenant_weights": '{"acme": 2}'}, adapter_command="tenant_weights"))
    assert weights.op == "tenant_weights" and weights.tenant_weights == {"acme": 2}
    with pytest.raises(InvalidRequestError, match="needs the request parameter 'tenant_weights'"):
        parse_adapter_command(_raw(adapter_command="tenant_weights"))
    with pytest.raises(InvalidRequestError, match="'replace' must be a boolean"):
        parse_adapter_command(_raw({"replace": "maybe"}, adapter_command="load", adapter_id="a"))
    assert admin_token(_raw({"admin_token": "s3cret"}, adapter_command="list")) == "s3cret"
    with pytest.raises(InvalidRequestError, match="'admin_token' must be a string"):
        admin_token(_raw({"admin_token": 5}, adapter_command="list"))


def test_admin_guard_needs_the_token_when_one_is_configured(tmp_path: Path) -> None:
    open_guard = AdminGuard(enabled=True, token=None)
    open_guard.check(None, "list")
    guard = AdminGuard(enabled=True, token="s3cret")
    guard.check("s3cret", "load")
    for given in (None, "wrong", "s3cret "):
        with pytest.raises(PermissionError, match="'load' needs the server's admin token"):
            guard.check(given, "load")
    with pytest.raises(PermissionError, match="disabled"):
        AdminGuard(enabled=False).check("s3cret", "list")
    (tmp_path / "token").write_text("  s3cret\n")
    assert read_token(tmp_path / "token") == "s3cret"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="admin_token_file .* is empty"):
        read_token(tmp_path / "empty")
    with pytest.raises(ValueError, match="cannot be read"):
        read_token(tmp_path / "missing")
