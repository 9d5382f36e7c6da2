"""Each bad request gets a clear message naming what is wrong, and only that request fails."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from slora.backend.engine.sampling_params import SamplingParams
from tests.serving.conftest import MAX_MODEL_LEN, MAX_WAITING, Server
from tests.serving.triton_calls import Collected, http_post, run_one, run_streams, text_inputs, token_inputs

pytestmark = pytest.mark.server

IDS = [1, 504, 3, 28, 1010, 30]


def _with(inputs: list[Any], name: str, array: np.ndarray, dtype: str) -> list[Any]:
    tensor = grpcclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return [*inputs, tensor]


def _raw_sampling(text: str) -> list[Any]:
    return _with(token_inputs(IDS, 4), "sampling_parameters", np.asarray([text.encode()], dtype=np.object_), "BYTES")


ERRORS: list[tuple[str, str, Any, tuple[str, ...]]] = [
    ("unknown adapter", "slora", lambda: token_inputs(IDS, 4, adapter="no-such-adapter"),
     ("'no-such-adapter'", "not registered")),
    ("adapter that fails to load", "slora", lambda: token_inputs(IDS, 4, adapter="broken"),
     ("'broken'", "cannot be read as safetensors")),
    ("empty prompt (ids)", "slora", lambda: token_inputs([], 4), ("the prompt is empty",)),
    ("empty prompt (text)", "ensemble", lambda: text_inputs(""), ("the prompt (text_input) is empty",)),
    ("prompt longer than the context", "slora", lambda: token_inputs([28] * (MAX_MODEL_LEN + 10), 4),
     ("prompt (522 tokens)", f"exceeds the model context of {MAX_MODEL_LEN} tokens")),
    ("max_tokens 0", "slora", lambda: token_inputs(IDS, 0), ("'max_tokens' must be >= 1, got 0",)),
    ("max_tokens negative", "ensemble", lambda: text_inputs("Hi", True, {"max_tokens": -3}),
     ("'max_tokens' must be >= 1, got -3",)),
    ("max_tokens too large", "slora", lambda: token_inputs(IDS, 100000),
     ("max_tokens (100000)", "exceeds the model context")),
    ("sampling_parameters not JSON", "slora", lambda: _raw_sampling("{temperature: 0"),
     ("'sampling_parameters' is not valid JSON",)),
    ("sampling_parameters not an object", "slora", lambda: _raw_sampling("[1, 2]"),
     ("must be a JSON object, got list",)),
    ("bad sampling value", "slora", lambda: token_inputs(IDS, 4, sampling={"temperature": -1}),
     ("'temperature' must be >= 0",)),
    ("bad sampling type", "ensemble", lambda: text_inputs("Hi", True, {"top_p": "high"}),
     ("'top_p' must be a finite number, got 'high'",)),
    ("unknown sampling key", "slora", lambda: token_inputs(IDS, 4, sampling={"bogus": 1}),
     ("unknown sampling parameter 'bogus'",)),
    ("unsupported sampling value", "slora", lambda: token_inputs(IDS, 4, sampling={"presence_penalty": 0.5}),
     ("'presence_penalty'=0.5 is not supported",)),
    ("two different adapters", "slora",
     lambda: token_inputs(IDS, 4, adapter="demo-qv-r4", sampling={"lora_name": "demo-o-r2"}),
     ("two different adapters", "'demo-qv-r4'", "'demo-o-r2'")),
    ("token id out of range", "slora", lambda: token_inputs([1, 10**6], 4), ("prompt token ids must be in",)),
    ("wrong dtype (input_ids FP32)", "slora",
     lambda: _with([], "input_ids", np.asarray([1.0, 2.0], dtype=np.float32), "FP32"),
     ("'input_ids' data-type is 'FP32'", "expects 'INT32'")),
    ("wrong dtype (max_tokens BYTES)", "slora",
     lambda: _with(token_inputs(IDS), "max_tokens", np.asarray([b"8"], dtype=np.object_), "BYTES"),
     ("'max_tokens' data-type is 'BYTES'",)),
    ("stream with the prompt included", "ensemble", lambda: text_inputs("Hi", True, exclude_input=False),
     ("exclude_input_in_output=false is not supported with stream=true",)),
]  # fmt: skip


def _good_requests(server: Server, reference: Any) -> tuple[dict[str, Any], list[Any]]:
    prompts = ["Tell me about the moon.", "Name a fruit:", "1, 2, 3,", "Dear diary,"]
    adapters = [None, "demo-all-r8", "demo-mlp-r16", "demo-qv-r4"]
    ids = [reference.tokenizer.encode(p, add_special_tokens=True) for p in prompts]
    requests = {f"good{i}": token_inputs(ids[i], 12, adapters[i], sampling={"temperature": 0}) for i in range(4)}
    expected = reference.generate(ids, adapters, [SamplingParams(max_tokens=12, temperature=0.0)] * 4)
    return requests, expected


def test_every_error_is_clear_and_concurrent_good_requests_finish(server: Server, reference: Any) -> None:
    requests, expected = _good_requests(server, reference)
    good: dict[str, Collected] = {}
    runner = threading.Thread(target=lambda: good.update(run_streams(server.grpc_url, "slora", requests)))
    runner.start()
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda case: run_one(server.grpc_url, case[1], case[2]()), ERRORS))
    runner.join(240)
    failures = []
    for (name, _, _, needles), result in zip(ERRORS, got):
        if result.error is None or not all(n in result.error for n in needles):
            failures.append(f"{name}: expected {needles}, got error={result.error!r} text={result.text!r}")
    assert not failures, "\n".join(failures)
    for i, completion in enumerate(expected):
        assert good[f"good{i}"].token_ids == completion.token_ids


def test_http_errors_name_the_problem(server: Server) -> None:
    body = {"input_ids": IDS, "adapter_id": "nope"}
    status, (payload,) = http_post(server.http_url, "/v2/models/slora/generate", body)
    assert status >= 400 and "'nope'" in payload["error"]
    status, (payload,) = http_post(server.http_url, "/v2/models/slora/generate", {"max_tokens": 4})
    assert status >= 400 and "the prompt is missing: give input 'text_input' (text) or 'input_ids'" in payload["error"]
    status, events = http_post(
        server.http_url, "/v2/models/ensemble/generate_stream", {"text_input": "Hi", "sampling_parameters": "{x"}
    )
    assert "not valid JSON" in events[-1]["error"]


def test_waiting_queue_bound_answers_unavailable(server: Server, reference: Any) -> None:
    """A burst far over max_num_seqs + max_waiting: the excess is refused at once, the rest completes."""
    total = 3 * MAX_WAITING
    responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    finished: set[str] = set()
    refused: list[str] = []
    try:
        for i in range(total):
            client.async_stream_infer("slora", token_inputs(IDS, 4, sampling={"temperature": 0}), request_id=f"b{i}",
                                      enable_empty_final_response=True)  # fmt: skip
        while len(finished) + len(refused) < total:
            result, error = responses.get(timeout=240)
            if error is not None:
                refused.append(error.message())
            elif result.get_response().parameters["triton_final_response"].bool_param:
                finished.add(result.get_response().id)
    finally:
        client.stop_stream()
        client.close()
    assert refused, "no request was refused"
    assert len(finished) >= MAX_WAITING
    for message in refused:
        assert f"(max_waiting={MAX_WAITING}); try again later" in message, message
