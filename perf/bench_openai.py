"""Replay traces through the OpenAI-compatible endpoint (slora-serve --openai-port), as bench_serving does over gRPC.

    python -m perf.bench_openai --url http://localhost:9000/v1 --out results.json traces/s1-n2000.jsonl

TRACE[@MODE] as in bench_engine. Each request is a streamed `/v1/completions` call sent at its arrival time:
`model` = its adapter (or the base model's name, read from /v1/models), `prompt` = its token ids as text (exact with
perf/make_model.py's word-level tokenizer), `max_tokens` = its output length, greedy, `ignore_eos`, and
`stream_options.include_usage`, whose usage gives the run's exact token counts. Every server-sent event is
timestamped on arrival. The run (kind "serving", target "openai") goes into the same results file as
bench_serving's, so that a trace replayed through gRPC and through this endpoint against one running server can be
compared (issue 28's target: this endpoint at >= 0.95 of gRPC's throughput). Adapters are expected in host memory
already (run bench_serving first, or start the server with preload_adapters=true).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from perf.bench_serving import TextOf, load_tokenizer
from perf.metrics import RequestRecord, per_request, summarize
from perf.results import append_runs, headline, make_run, trace_info
from perf.workload import RunSpec, TraceRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpenAIOptions:
    url: str = "http://localhost:9000/v1"
    time_limit_s: float = 600.0
    max_connections: int = 1024
    progress_bar: bool = False
    window_fraction: float = 0.25


class OpenAIReplay:
    """Sends a trace's requests at their arrival times; one streamed completion each."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        base_model: str,
        requests: list[TraceRequest],
        text_of: TextOf,
        count_tokens: Callable[[str], int],
        options: OpenAIOptions,
    ) -> None:
        self.client = client
        self.base_model = base_model
        self.requests = requests
        self.text_of = text_of
        self.count_tokens = count_tokens
        self.options = options
        self.records = {r.index: RequestRecord(r.index, r.adapter, r.input_len, r.output_len, r.arrival)
                        for r in requests}  # fmt: skip
        self.usage_tokens = 0  # completion tokens as the server's usage counts them
        self.errors: list[str] = []
        self.start = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.start

    async def run(self) -> float:
        """Replay; returns the duration (to the last finish)."""
        self.start = time.perf_counter()
        off = None if self.options.progress_bar else True
        with tqdm(total=len(self.requests), desc="openai", unit="req", disable=off, leave=False) as bar:
            tasks = [asyncio.create_task(self._one(r, bar)) for r in self.requests]
            done, pending = await asyncio.wait(tasks, timeout=self.options.time_limit_s)
        for task in pending:
            task.cancel()
        finished = [r.finish_time for r in self.records.values() if r.finish_time is not None]
        return max(finished) if not pending and finished else self.now()

    async def _one(self, request: TraceRequest, bar: tqdm) -> None:
        delay = request.arrival - self.now()
        if delay > 0:
            await asyncio.sleep(delay)
        record = self.records[request.index]
        try:
            await self._stream(request, record)
        except (httpx.HTTPError, ValueError) as exc:
            record.finish(self.now(), "error", str(exc))
            self.errors.append(str(exc))
        bar.update(1)

    async def _stream(self, request: TraceRequest, record: RequestRecord) -> None:
        body = {"model": request.adapter or self.base_model, "prompt": self.text_of(list(request.prompt_ids)),
                "max_tokens": request.output_len, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        async with self.client.stream("POST", "/completions", json=body) as response:
            if response.status_code != 200:
                raise ValueError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
            reason = None
            async for line in response.aiter_lines():
                reason = self._event(line, record) or reason
        record.finish(self.now(), reason or "length")

    def _event(self, line: str, record: RequestRecord) -> str | None:
        """Fold one server-sent event into `record`; returns the finish reason it carries, if any."""
        if not line.startswith("data: ") or line == "data: [DONE]":
            return None
        event = json.loads(line[len("data: ") :])
        if event.get("usage"):
            completion = int(event["usage"].get("completion_tokens", 0))
            self.usage_tokens += completion
            record.settle_tokens(completion)
        choices = event.get("choices") or []
        if not choices:
            return None
        text = choices[0].get("text") or ""
        record.add_chunk(self.now(), self.count_tokens(text) if text else 0)
        return choices[0].get("finish_reason")


async def base_model_name(client: httpx.AsyncClient) -> str:
    """The base model's name on this server: the /v1/models entry that is no adapter."""
    response = await client.get("/models")
    response.raise_for_status()
    for card in response.json()["data"]:
        if (card.get("slora") or {}).get("kind") == "base":
            return str(card["id"])
    raise RuntimeError("no base model in /v1/models")


async def run_one(
    spec: RunSpec, options: OpenAIOptions, name: str, text_of: TextOf, count_tokens: Callable[[str], int]
) -> dict[str, Any]:
    """One measured replay of `spec` through the OpenAI endpoint; its results-file run."""
    trace = spec.load()
    limits = httpx.Limits(max_connections=options.max_connections, max_keepalive_connections=options.max_connections)
    async with httpx.AsyncClient(base_url=options.url, timeout=None, limits=limits) as client:
        base = await base_model_name(client)
        logger.info("run %s: %s (%d requests, mode %s) through %s", name, spec.trace_path, len(trace), spec.mode,
                    options.url)  # fmt: skip
        replay = OpenAIReplay(client, base, list(trace.requests), text_of, count_tokens, options)
        duration = await replay.run()
    records = list(replay.records.values())
    metrics = summarize(records, duration, options.window_fraction)
    metrics.update(usage_completion_tokens=replay.usage_tokens, errors=len(replay.errors),
                   first_errors=replay.errors[:3])  # fmt: skip
    info = {**asdict(options), "mode": spec.mode, "target": {"kind": "openai", "model": base}}
    return make_run(name, "serving", trace_info(trace, spec.trace_path), info, metrics, group="serving-openai",
                    per_request=per_request(records))  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="TRACE[@MODE]")
    parser.add_argument("--url", default="http://localhost:9000/v1", help="the OpenAI endpoint's base URL")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer dir (default: perf/make_model's word-level one)")
    parser.add_argument("--time-limit", type=float, default=600.0)
    parser.add_argument("--name-prefix", default="openai")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    text_of, count_tokens = load_tokenizer(args.tokenizer)
    options = OpenAIOptions(args.url, args.time_limit, progress_bar=not args.no_progress)
    for text in args.runs:
        spec = RunSpec.parse(text)
        name = f"{args.name_prefix}-{spec.trace_path.stem}-{spec.mode}"
        run = asyncio.run(run_one(spec, options, name, text_of, count_tokens))
        append_runs(args.out, [run])
        logger.info("%s", headline(run))


if __name__ == "__main__":
    main()
