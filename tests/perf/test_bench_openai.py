"""bench_openai's replay against a stand-in OpenAI endpoint (httpx.MockTransport): what it sends, what it times."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from perf import bench_openai
from perf.workload import RunSpec, TraceConfig, generate_trace, save_trace


def _endpoint(seen: list[dict], blank_first: bool = False) -> httpx.MockTransport:
    """/v1/models lists a base model; /v1/completions streams one word per event, then the usage. With
    `blank_first`, the first token's event has no text (a special token, which decodes to nothing)."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            cards = [{"id": "tiny-base", "slora": {"kind": "base"}}, {"id": "s1-0", "slora": {"kind": "adapter"}}]
            return httpx.Response(200, json={"data": cards})
        body = json.loads(request.content)
        seen.append(body)
        words = ["w"] * body["max_tokens"]
        events = [{"choices": [{"text": f" {w}", "finish_reason": None}]} for w in words[:-1]]
        if blank_first and events:
            events[0]["choices"][0]["text"] = ""
        events.append({"choices": [{"text": f" {words[-1]}", "finish_reason": "length"}]})
        events.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": len(words)}})
        lines = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=lines.encode(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handle)


def test_replay_sends_each_request_and_counts_every_token(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    trace = generate_trace(TraceConfig(num_adapters=2, req_rate=50.0, duration=0.2, input_range=(4, 8),
                                       output_range=(3, 6), vocab_size=100, seed=1))  # fmt: skip
    path = save_trace(trace, tmp_path / "t.jsonl")
    seen: list[dict] = []
    transport = _endpoint(seen)
    real_client = httpx.AsyncClient
    monkeypatch.setattr(bench_openai.httpx, "AsyncClient",
                        lambda **kwargs: real_client(transport=transport, **kwargs))  # fmt: skip

    def text_of(ids: list[int]) -> str:
        return " ".join(f"t{i}" for i in ids)

    def count(text: str) -> int:
        return len(text.split())

    options = bench_openai.OpenAIOptions(url="http://stand-in/v1")
    run = asyncio.run(bench_openai.run_one(RunSpec(path), options, "openai-t", text_of, count))
    assert len(seen) == len(trace.requests)
    by_prompt = {body["prompt"]: body for body in seen}
    for request in trace.requests:
        body = by_prompt[text_of(list(request.prompt_ids))]
        assert body["model"] == (request.adapter or "tiny-base") and body["max_tokens"] == request.output_len
        assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["temperature"] == 0
    metrics = run["metrics"]
    assert metrics["num_finished"] == len(trace.requests) and metrics["num_short"] == 0
    assert metrics["usage_completion_tokens"] == sum(r.output_len for r in trace.requests)
    assert run["options"]["target"] == {"kind": "openai", "model": "tiny-base"}
    base_run = asyncio.run(bench_openai.run_one(RunSpec(path, "base"), options, "openai-b", text_of, count))
    assert base_run["metrics"]["num_finished"] == len(trace.requests)
    assert all(body["model"] == "tiny-base" for body in seen[len(trace.requests) :])


def test_tokens_without_text_are_counted_from_the_usage(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A token whose text is empty is not seen in the stream; the request's usage counts it, so no request is
    reported short of its max_tokens."""
    trace = generate_trace(TraceConfig(num_adapters=2, req_rate=50.0, duration=0.2, input_range=(4, 8),
                                       output_range=(3, 6), vocab_size=100, seed=2))  # fmt: skip
    path = save_trace(trace, tmp_path / "t.jsonl")
    transport = _endpoint([], blank_first=True)
    real_client = httpx.AsyncClient
    monkeypatch.setattr(bench_openai.httpx, "AsyncClient",
                        lambda **kwargs: real_client(transport=transport, **kwargs))  # fmt: skip
    options = bench_openai.OpenAIOptions(url="http://stand-in/v1")
    run = asyncio.run(bench_openai.run_one(RunSpec(path), options, "openai-t", lambda ids: " ".join(map(str, ids)),
                                           lambda text: len(text.split())))  # fmt: skip
    metrics = run["metrics"]
    assert metrics["num_finished"] == len(trace.requests) and metrics["num_short"] == 0
    assert metrics["output_tok_s"] * metrics["duration_s"] == pytest.approx(sum(r.output_len for r in trace.requests))
