"""Served greedy outputs equal the in-process engine's: token streams of `slora`, text of the ensemble."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from slora.backend.engine.sampling_params import SamplingParams
from tests.serving.conftest import REGISTRY_ADAPTER, Server
from tests.serving.triton_calls import Collected, http_post, run_one, run_streams, text_inputs, token_inputs

pytestmark = pytest.mark.server

PROMPTS = [
    "Hello, how are you?",
    "The capital of France is",
    "Write three emojis:",  # multi-byte characters split across tokens
    "Say hello in Russian:",
    "List three colors:",
    "Once upon a time",
]
GREEDY = {"temperature": 0}


def _adapters(server: Server) -> list[str | None]:
    return [None, *server.demo_adapters, REGISTRY_ADAPTER]


def _reference(reference: Any, prompts: list[Any], adapters: list[str | None], **sampling: Any) -> list[Any]:
    params = SamplingParams(temperature=0.0, **sampling)
    return reference.generate(prompts, adapters, [params] * len(prompts))


def test_36_token_streams_over_6_adapters_equal_the_engine(server: Server, reference: Any) -> None:
    cases = [(p, a) for a in _adapters(server) for p in PROMPTS]  # 36 streams, 6 adapters (incl. base)
    ids = [reference.tokenizer.encode(p, add_special_tokens=True) for p, _ in cases]
    requests = {
        f"r{i}": token_inputs(ids[i], max_tokens=8, adapter=adapter, sampling=GREEDY)
        for i, (_, adapter) in enumerate(cases)
    }
    groups = [dict(list(requests.items())[k::4]) for k in range(4)]  # four gRPC connections, 9 streams each
    with ThreadPoolExecutor(4) as pool:
        results: dict[str, Collected] = {}
        for part in pool.map(lambda g: run_streams(server.grpc_url, "slora", g), groups):
            results.update(part)
    expected = _reference(reference, ids, [a for _, a in cases], max_tokens=8)
    for i, completion in enumerate(expected):
        got = results[f"r{i}"]
        assert got.error is None, got.error
        assert got.token_ids == completion.token_ids, f"stream r{i} ({cases[i]})"
        assert got.finish_reason == completion.finish_reason
        assert got.final
        # One response per engine step, the last one FINAL; steps that queued up while the responder was busy
        # go out merged, so never more responses than tokens.
        assert 1 <= got.responses <= len(completion.token_ids)
        # None named: all the generation outputs but text_output, which a token request gets only by name.
        assert got.output_names == {"output_ids", "finish_reason", "num_input_tokens", "num_output_tokens"}


def test_a_token_client_gets_only_the_outputs_it_names(server: Server, reference: Any) -> None:
    ids = [reference.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS[:3]]
    requests = {f"r{i}": token_inputs(p, max_tokens=6, sampling=GREEDY) for i, p in enumerate(ids)}
    results = run_streams(server.grpc_url, "slora", requests, outputs=["output_ids"])
    expected = _reference(reference, ids, [None] * len(ids), max_tokens=6)
    for i, completion in enumerate(expected):
        got = results[f"r{i}"]
        assert got.error is None and got.final, got.error
        assert got.token_ids == completion.token_ids
        assert got.output_names == {"output_ids"}


def test_slora_without_stream_sends_one_response(server: Server, reference: Any) -> None:
    ids = reference.tokenizer.encode(PROMPTS[1], add_special_tokens=True)
    got = run_one(server.grpc_url, "slora", token_inputs(ids, max_tokens=6, stream=False, sampling=GREEDY))
    expected = _reference(reference, [ids], [None], max_tokens=6)[0]
    assert (got.responses, got.token_ids, got.finish_reason) == (1, expected.token_ids, expected.finish_reason)


def test_ensemble_stream_deltas_concatenate_to_the_engine_text(server: Server, reference: Any) -> None:
    adapters = _adapters(server)
    cases = [(p, adapters[i % len(adapters)]) for i, p in enumerate(PROMPTS)]
    sampling = {"temperature": 0, "max_tokens": 16}
    requests = {f"s{i}": text_inputs(p, True, sampling, a) for i, (p, a) in enumerate(cases)}
    requests.update({f"w{i}": text_inputs(p, False, sampling, a, exclude_input=True) for i, (p, a) in enumerate(cases)})
    streamed = whole = run_streams(server.grpc_url, "ensemble", requests)  # 12 at once: 6 streamed, 6 whole
    expected = _reference(reference, [p for p, _ in cases], [a for _, a in cases], max_tokens=16)
    assert any(ord(c) > 0x7FF for c in expected[2].text + expected[3].text), "no multi-byte text was generated"
    for i, completion in enumerate(expected):
        assert streamed[f"s{i}"].text == completion.text, cases[i]
        assert streamed[f"s{i}"].finish_reason == completion.finish_reason
        assert whole[f"w{i}"].responses == 1 and whole[f"w{i}"].text == completion.text


def test_ensemble_includes_the_prompt_when_not_streaming_by_default(server: Server, reference: Any) -> None:
    got = run_one(server.grpc_url, "ensemble", text_inputs(PROMPTS[0], False, {"temperature": 0, "max_tokens": 6}))
    expected = _reference(reference, [PROMPTS[0]], [None], max_tokens=6)[0]
    assert got.text == PROMPTS[0] + expected.text


def test_ensemble_stop_strings_and_seeded_sampling(server: Server, reference: Any) -> None:
    stop = {"temperature": 0, "max_tokens": 24, "stop": ["."]}
    got = run_one(server.grpc_url, "ensemble", text_inputs(PROMPTS[0], True, stop))
    expected = _reference(reference, [PROMPTS[0]], [None], max_tokens=24, stop=(".",))[0]
    assert (got.text, got.finish_reason) == (expected.text, "stop")
    seeded = {"temperature": 0.8, "top_p": 0.9, "seed": 7, "max_tokens": 12}
    first, second = (run_one(server.grpc_url, "ensemble", text_inputs(PROMPTS[5], True, seeded)) for _ in range(2))
    assert first.text == second.text != ""


def test_ensemble_chat_template_parameter(server: Server, reference: Any) -> None:
    tokenizer = reference.tokenizer
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[4]}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    got = run_one(server.grpc_url, "ensemble", text_inputs(PROMPTS[4], True, {"temperature": 0, "max_tokens": 10}),
                  parameters={"apply_chat_template": True})  # fmt: skip
    assert got.text == _reference(reference, [ids], [None], max_tokens=10)[0].text


def test_http_generate_and_generate_stream(server: Server, reference: Any) -> None:
    body = {"text_input": PROMPTS[2], "sampling_parameters": '{"temperature": 0, "max_tokens": 12}',
            "adapter_id": "demo-all-r8", "exclude_input_in_output": True}  # fmt: skip
    expected = _reference(reference, [PROMPTS[2]], ["demo-all-r8"], max_tokens=12)[0]
    status, events = http_post(server.http_url, "/v2/models/ensemble/generate_stream", {**body, "stream": True})
    assert status == 200 and len(events) == len(expected.token_ids)
    assert "".join(e["text_output"] for e in events) == expected.text
    assert events[-1]["finish_reason"] == expected.finish_reason
    status, (single,) = http_post(server.http_url, "/v2/models/ensemble/generate", body)
    assert status == 200 and single["text_output"] == expected.text
    # vLLM-style request parameters instead of the JSON input
    params = {"text_input": PROMPTS[2], "parameters": {"temperature": 0, "max_tokens": 12, "lora_name": "demo-all-r8"}}
    status, events = http_post(server.http_url, "/v2/models/ensemble/generate_stream", {**params, "stream": True})
    assert status == 200 and "".join(e["text_output"] for e in events) == expected.text
    # genai-perf's request: numbers as strings in sampling_parameters, the adapter as lora_name
    genai = {"text_input": PROMPTS[2], "exclude_input_in_output": True, "stream": True,
             "sampling_parameters": '{"max_tokens": "12", "lora_name": "demo-all-r8", "temperature": "0"}'}  # fmt: skip
    status, events = http_post(server.http_url, "/v2/models/ensemble/generate_stream", genai)
    assert status == 200 and "".join(e["text_output"] for e in events) == expected.text
