"""A client that goes away mid-generation gets its request aborted: its KV pages are free again at once."""

from __future__ import annotations

import json
import queue
import socket
from typing import Any

import pytest
import tritonclient.grpc as grpcclient

from tests.serving.conftest import Server
from tests.serving.triton_calls import scrape, text_inputs, token_inputs, wait_for_metric

pytestmark = pytest.mark.server

KV = 'slora_pool_pages{kind="kv"}'
ABORTED = 'slora_requests_finished_total{reason="abort"}'
LONG = {"temperature": 0, "ignore_eos": True}  # 400 tokens: tens of seconds on CPU unless cancelled


def _ids(reference: Any) -> list[int]:
    return list(reference.tokenizer.encode("Write a very long story about a dragon.", add_special_tokens=True))


@pytest.mark.parametrize("model", ["slora", "ensemble"])
def test_grpc_stream_cancel_frees_pages(server: Server, reference: Any, model: str) -> None:
    """The ensemble alias checks its own requests for cancellation: the cancel reaches the engine there too."""
    wait_for_metric(server.metrics_url, KV, lambda v: v == 0)
    aborted = scrape(server.metrics_url)[ABORTED]
    responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    inputs = (
        token_inputs(_ids(reference), 400, sampling=LONG)
        if model == "slora"
        else text_inputs("Write a very long story about a dragon.", True, {**LONG, "max_tokens": 400})
    )
    try:
        client.async_stream_infer(model, inputs, request_id="long")
        for _ in range(3):
            result, error = responses.get(timeout=60)
            assert error is None, error
        assert wait_for_metric(server.metrics_url, KV, lambda v: v > 0) > 0
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    wait_for_metric(server.metrics_url, KV, lambda v: v == 0, timeout_s=10)
    wait_for_metric(server.metrics_url, ABORTED, lambda v: v == aborted + 1, timeout_s=10)


def test_dropped_http_sse_connection_frees_pages(server: Server, reference: Any) -> None:
    wait_for_metric(server.metrics_url, KV, lambda v: v == 0)
    aborted = scrape(server.metrics_url)[ABORTED]
    body = json.dumps({"input_ids": _ids(reference), "max_tokens": 400, "stream": True,
                       "sampling_parameters": json.dumps(LONG)}).encode()  # fmt: skip
    host, port = server.http_url.split(":")
    with socket.create_connection((host, int(port)), timeout=60) as connection:
        connection.sendall(
            b"POST /v2/models/slora/generate_stream HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body)
        )
        received = b""
        while received.count(b"data:") < 3:
            received += connection.recv(4096)
        assert wait_for_metric(server.metrics_url, KV, lambda v: v > 0) > 0
    wait_for_metric(server.metrics_url, KV, lambda v: v == 0, timeout_s=10)
    wait_for_metric(server.metrics_url, ABORTED, lambda v: v == aborted + 1, timeout_s=10)
