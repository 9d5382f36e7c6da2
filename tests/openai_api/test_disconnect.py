"""A client that leaves mid-generation gets its request aborted in slora: 0 KV pages in use right after."""

from __future__ import annotations

import httpx
import pytest

from tests.openai_api.conftest import BASE, OpenAIServer
from tests.serving.triton_calls import scrape, wait_for_metric

pytestmark = pytest.mark.server

KV = 'slora_pool_pages{kind="kv"}'
ABORTED = 'slora_requests_finished_total{reason="abort"}'
LONG = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}  # tens of seconds on CPU unless aborted


def _idle(server: OpenAIServer) -> float:
    wait_for_metric(server.metrics_url, KV, lambda v: v == 0, timeout_s=30)
    return scrape(server.metrics_url)[ABORTED]


def test_closing_a_chat_stream_frees_its_pages(openai_server: OpenAIServer) -> None:
    aborted = _idle(openai_server)
    stream = openai_server.client().chat.completions.create(
        model="demo-qv-r4", messages=[{"role": "user", "content": "Write a very long story about a dragon."}],
        stream=True, extra_body={"ignore_eos": True}, max_tokens=400, temperature=0,
    )  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert wait_for_metric(openai_server.metrics_url, KV, lambda v: v > 0) > 0
    stream.close()
    wait_for_metric(openai_server.metrics_url, KV, lambda v: v == 0, timeout_s=10)
    wait_for_metric(openai_server.metrics_url, ABORTED, lambda v: v == aborted + 1, timeout_s=10)


def test_dropping_a_whole_completion_frees_its_pages(openai_server: OpenAIServer) -> None:
    """Not streamed: the client times out and leaves while slora still generates."""
    aborted = _idle(openai_server)
    body = {"model": BASE, "prompt": "Write a very long story about a dragon.", **LONG}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{openai_server.openai_url}/completions", json=body, timeout=4)
    wait_for_metric(openai_server.metrics_url, KV, lambda v: v == 0, timeout_s=10)
    wait_for_metric(openai_server.metrics_url, ABORTED, lambda v: v == aborted + 1, timeout_s=10)
