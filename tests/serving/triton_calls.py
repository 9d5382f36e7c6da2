"""Small tritonclient / HTTP helpers for the server tests: build inputs, stream, collect, scrape metrics."""

from __future__ import annotations

import json
import queue
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient


@dataclass
class Collected:
    """What one streamed request received."""

    token_ids: list[int] = field(default_factory=list)
    output_names: set[str] = field(default_factory=set)  # every output name seen in its responses
    texts: list[str] = field(default_factory=list)
    finish_reason: str = ""
    responses: int = 0
    final: bool = False
    error: str | None = None
    first_token_at: float | None = None  # time.monotonic() of the first response carrying a token

    @property
    def text(self) -> str:
        return "".join(self.texts)


def _tensor(name: str, array: np.ndarray) -> grpcclient.InferInput:
    dtype = {"i": "INT32", "b": "BOOL", "O": "BYTES", "f": "FP32"}[array.dtype.kind]
    tensor = grpcclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def _bytes(text: str) -> np.ndarray:
    return np.asarray([text.encode()], dtype=np.object_)


def token_inputs(
    ids: Iterable[int],
    max_tokens: int | None = None,
    adapter: str | None = None,
    stream: bool = True,
    sampling: dict[str, Any] | None = None,
) -> list[grpcclient.InferInput]:
    inputs = [_tensor("input_ids", np.asarray(list(ids), dtype=np.int32)), _tensor("stream", np.asarray([stream]))]
    if max_tokens is not None:
        inputs.append(_tensor("max_tokens", np.asarray([max_tokens], dtype=np.int32)))
    if adapter is not None:
        inputs.append(_tensor("adapter_id", _bytes(adapter)))
    if sampling is not None:
        inputs.append(_tensor("sampling_parameters", _bytes(json.dumps(sampling))))
    return inputs


def text_inputs(
    prompt: str,
    stream: bool = True,
    sampling: dict[str, Any] | None = None,
    adapter: str | None = None,
    exclude_input: bool | None = None,
) -> list[grpcclient.InferInput]:
    inputs = [_tensor("text_input", _bytes(prompt)), _tensor("stream", np.asarray([stream]))]
    if sampling is not None:
        inputs.append(_tensor("sampling_parameters", _bytes(json.dumps(sampling))))
    if adapter is not None:
        inputs.append(_tensor("adapter_id", _bytes(adapter)))
    if exclude_input is not None:
        inputs.append(_tensor("exclude_input_in_output", np.asarray([exclude_input])))
    return inputs


def _fold(collected: Collected, result: Any) -> None:
    response = result.get_response()
    collected.responses += 1
    collected.output_names.update(output.name for output in response.outputs)
    ids = result.as_numpy("output_ids")
    if ids is not None:
        if ids.size and collected.first_token_at is None:
            collected.first_token_at = time.monotonic()
        collected.token_ids += ids.tolist()
    text = result.as_numpy("text_output")
    if text is not None and text.size:
        collected.texts.append(text.reshape(-1)[0].decode())
    reason = result.as_numpy("finish_reason")
    if reason is not None and reason.size and reason.reshape(-1)[0]:
        collected.finish_reason = reason.reshape(-1)[0].decode()
    final = response.parameters.get("triton_final_response")
    collected.final = bool(final is not None and final.bool_param)


def run_streams(
    url: str,
    model: str,
    requests: dict[str, list[grpcclient.InferInput]],
    timeout_s: float = 240.0,
    parameters: dict[str, Any] | None = None,
    outputs: list[str] | None = None,
) -> dict[str, Collected]:
    """Send every request on one gRPC stream and collect each one's responses until its FINAL flag.

    `outputs` names the outputs to ask for (default: none named, so the server sends all of them)."""
    requested = [grpcclient.InferRequestedOutput(name) for name in outputs] if outputs else None
    results = {request_id: Collected() for request_id in requests}
    responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        for request_id, inputs in requests.items():
            client.async_stream_infer(model, inputs, request_id=request_id, parameters=parameters,
                                      outputs=requested, enable_empty_final_response=True)  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not all(r.final or r.error for r in results.values()):
            result, error = responses.get(timeout=max(deadline - time.monotonic(), 0.1))
            if error is not None:
                # Stream errors carry no request id: give each request its own stream when errors are expected.
                pending = [r for r in results.values() if not r.final and not r.error]
                if len(pending) != 1:
                    raise AssertionError(f"unattributable stream error: {error.message()}")
                pending[0].error = error.message()
                continue
            _fold(results[result.get_response().id], result)
    finally:
        client.stop_stream()
        client.close()
    return results


def run_one(url: str, model: str, inputs: list[grpcclient.InferInput], **kwargs: Any) -> Collected:
    return run_streams(url, model, {"only": inputs}, **kwargs)["only"]


def http_post(url: str, path: str, body: dict[str, Any], timeout_s: float = 240.0) -> tuple[int, list[dict[str, Any]]]:
    """POST JSON; returns the status and the JSON payloads (one, or one per server-sent event)."""
    request = urllib.request.Request(f"http://{url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read().decode(), exc.code
    if raw.startswith("data:"):
        return status, [json.loads(line[5:]) for line in raw.splitlines() if line.startswith("data:")]
    return status, [json.loads(raw)]


_SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)$")


def scrape(metrics_url: str) -> dict[str, float]:
    """Every series of the metrics endpoint: 'name{labels}' → value."""
    with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {m[1]: float(m[2]) for line in lines if (m := _SERIES.match(line))}


def wait_for_metric(metrics_url: str, series: str, predicate: Any, timeout_s: float = 15.0) -> float:
    """Scrape until `series` satisfies `predicate`. A failed connection is retried too, until the deadline: the
    metrics port is a listener of its own, scraped here right after the HTTP port answered ready."""
    deadline = time.monotonic() + timeout_s
    value = float("nan")
    while time.monotonic() < deadline:
        try:
            value = scrape(metrics_url).get(series, float("nan"))
        except OSError:
            value = float("nan")
        if predicate(value):
            return value
        time.sleep(0.1)
    raise AssertionError(f"{series} = {value} did not reach the expected value within {timeout_s} s")
