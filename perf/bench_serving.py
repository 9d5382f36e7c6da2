"""Replay traces against the running Triton server over tritonclient's asyncio gRPC streaming.

    python -m perf.bench_serving --url localhost:8001 --target slora --out results.json traces/s1-n2000.jsonl
    python -m perf.bench_serving --target ensemble --tokenizer /tmp/slora-perf/model --out r.json TRACE@base

TRACE[@MODE] as in bench_engine (lora | base | single); the same metrics and results file, kind "serving".
Requests are sent when their arrival time comes, over `--streams` bidirectional gRPC streams (round robin), and
every streamed response is timestamped on arrival. Before the clock starts, the trace's adapters are loaded into
the server's host memory with `adapter_command` load requests (as bench_engine preloads them; see
preload_adapters for the fallback), and a few short requests warm the kernels. The client's own CPU use is
reported (`client_cpu_share`): near 1.0, the Python client rather than the server may be the bottleneck; then
try more `--streams`.

Targets (see perf/triton_protocol.py): `slora` (token ids in and out) and `ensemble` (text, vLLM-backend I/O;
prompt token ids are rendered with the model's tokenizer, exact with perf/make_model.py's word-level one).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from perf import serving_admin
from perf.bench_engine import MODES, RunSpec
from perf.metrics import RequestRecord, per_request, summarize
from perf.results import append_runs, headline, make_run, trace_info
from perf.triton_protocol import ModelIO, StreamState, Target, decode, encode
from perf.workload import Trace, TraceRequest

logger = logging.getLogger(__name__)

_END = object()
TextOf = Callable[[list[int]], str]  # prompt token ids -> prompt text (the text target)


@dataclass(frozen=True)
class ServingOptions:
    streams: int = 1
    time_limit_s: float = 600.0
    idle_timeout_s: float = 60.0  # all sent and nothing received for this long: give up on the rest
    warmup_requests: int = 8
    preload: bool = True
    preload_concurrency: int = 64
    admin_model: str = "slora"  # the model that takes adapter commands (preload into host memory, list)
    server_kernel_backend: str | None = None  # what the server runs, as told by whoever started it (for pairing)
    progress_interval_s: float = 5.0
    window_fraction: float = 0.25

    def __post_init__(self) -> None:
        if self.streams < 1 or self.preload_concurrency < 1:
            raise ValueError("streams and preload_concurrency must be >= 1")
        for name in ("time_limit_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class Client:
    """What the replay needs from tritonclient (a fake one stands in for it in the tests)."""

    def __init__(self, url: str) -> None:
        import tritonclient.grpc.aio as grpc_aio

        self._grpc = grpc_aio.InferenceServerClient(url)
        self.infer_input = grpc_aio.InferInput
        self.requested_output = grpc_aio.InferRequestedOutput

    def stream_infer(self, iterator: Any) -> Any:
        return self._grpc.stream_infer(iterator)

    async def model_io(self, model: str) -> ModelIO:
        try:
            return ModelIO.from_config(await self._grpc.get_model_config(model, as_json=True))
        except Exception as exc:  # a model without a readable config: send every input
            logger.warning("could not read the config of model %r (%s); sending every input", model, exc)
            return ModelIO()

    async def wait_ready(self, model: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if await self._grpc.is_server_ready() and await self._grpc.is_model_ready(model):
                    return
            except Exception:  # not up yet
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"model {model!r} not ready after {timeout_s:.0f}s")
            await asyncio.sleep(1.0)

    async def close(self) -> None:
        await self._grpc.close()


class StreamReplay:
    """Sends requests at their arrival times over several streams; records what comes back."""

    def __init__(
        self,
        client: Any,
        target: Target,
        io: ModelIO,
        requests: list[TraceRequest],
        options: ServingOptions,
        text_of: TextOf | None,
        count_tokens: Callable[[str], int],
        max_tokens: int | None = None,
    ) -> None:
        self.client = client
        self.target = target
        self.io = io
        self.requests = requests
        self.options = options
        self.text_of = text_of
        self.count_tokens = count_tokens
        self.max_tokens = max_tokens
        self.records = {self._rid(r): RequestRecord(r.index, r.adapter, r.input_len, r.output_len, r.arrival)
                        for r in requests}  # fmt: skip
        self.states: dict[str, StreamState] = {}
        self.open: set[str] = set()
        self.stream_errors: list[str] = []
        self.unattributed_errors = 0  # tritonclient's aio stream drops the request id of an error response
        self.start = 0.0
        self._last_response = 0.0
        self._all_sent = asyncio.Event()
        self._done = asyncio.Event()

    def _rid(self, r: TraceRequest) -> str:
        return f"r{r.index}"

    def now(self) -> float:
        return time.perf_counter() - self.start

    async def run(self) -> float:
        """Replay; returns the duration (to the last finish, or to when it gave up)."""
        self.start = time.perf_counter()
        self._last_response = 0.0
        queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(self.options.streams)]
        receivers = [asyncio.create_task(self._receive(q)) for q in queues]
        watcher = asyncio.create_task(self._watch())
        try:
            await self._send(queues)
            await self._done.wait()
        finally:
            for q in queues:
                q.put_nowait(_END)
            for task in (*receivers, watcher):
                task.cancel()
            await asyncio.gather(*receivers, watcher, return_exceptions=True)
        finished = [r.finish_time for r in self.records.values() if r.finish_time is not None]
        return max(finished) if not self.open and finished else self.now()

    async def _send(self, queues: list[asyncio.Queue]) -> None:
        for i, r in enumerate(self.requests):
            delay = r.arrival - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            rid = self._rid(r)
            prompt_text = self.text_of(list(r.prompt_ids)) if self.text_of and self.target.kind == "text" else ""
            self.states[rid] = StreamState(self.max_tokens or r.output_len, prompt_text)
            self.open.add(rid)
            queues[i % len(queues)].put_nowait(
                encode(
                    r,
                    rid,
                    self.target,
                    self.io,
                    self.client.infer_input,
                    self.text_of,
                    self.max_tokens,
                    getattr(self.client, "requested_output", None),
                )  # fmt: skip
            )
        self._all_sent.set()
        if len(self.open) <= self.unattributed_errors:
            self._done.set()

    async def _receive(self, queue: asyncio.Queue) -> None:
        async def requests() -> Any:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                yield item

        async for result, error in self.client.stream_infer(requests()):
            self._last_response = self.now()
            if error is not None:
                self._on_error(result, error)
            else:
                self._on_result(result)
            if self._all_sent.is_set() and len(self.open) <= self.unattributed_errors:
                self._done.set()  # every open request is finished or (as far as we can tell) failed

    def _on_result(self, result: Any) -> None:
        rid = result.get_response().id
        state = self.states.get(rid)
        if state is None or rid not in self.open:
            return
        chunk = decode(result, self.target, state, self.count_tokens)
        record = self.records[rid]
        t = self.now()
        record.add_chunk(t, chunk.num_tokens)
        if chunk.final:
            record.finish(t, chunk.finish_reason or "length")
            self.open.discard(rid)

    def _on_error(self, result: Any, error: Any) -> None:
        message = str(error)
        self.stream_errors.append(message)
        if len(self.stream_errors) <= 5:
            logger.warning("server error: %s", message)
        rid = result.get_response().id if result is not None else None
        if rid in self.open:
            self.records[rid].finish(self.now(), "error", message)
            self.open.discard(rid)
        else:
            self.unattributed_errors += 1

    async def _watch(self) -> None:
        """Progress lines; ends the replay at the time limit or when the server has gone quiet."""
        last_log = 0.0
        while not self._done.is_set():
            await asyncio.sleep(min(self.options.progress_interval_s, 0.5))
            now = self.now()
            quiet = now - self._last_response
            if now > self.options.time_limit_s or (self._all_sent.is_set() and quiet > self.options.idle_timeout_s):
                logger.warning("giving up with %d requests open (t=%.0fs, quiet for %.0fs)", len(self.open), now,
                               quiet)  # fmt: skip
                self._done.set()
                return
            if now - last_log >= self.options.progress_interval_s:
                self._progress(now)
                last_log = now

    def _progress(self, now: float) -> None:
        done = sum(1 for r in self.records.values() if r.finish_time is not None)
        tokens = sum(r.num_output for r in self.records.values())
        logger.info("t=%6.1fs sent %d/%d finished %d open %d | %.0f out tok/s", now, len(self.states),
                    len(self.records), done, len(self.open), tokens / max(now, 1e-9))  # fmt: skip


async def preload_adapters(
    client: Any, target: Target, io: ModelIO, trace: Trace, options: ServingOptions, text_of: TextOf | None
) -> tuple[float, str]:
    """Get the trace's adapters into the server's host memory; returns (seconds, how).

    With `adapter_command` load requests to the admin model they go to host memory only, as bench_engine's
    preload does. Where the server takes no adapter commands, one 1-token request per adapter does it, which also
    makes them resident on the GPU (a warmer start than the in-process runs get; recorded as `preload_via`).
    """
    names = trace.adapters()
    start = time.perf_counter()
    if not names:
        return 0.0, "none"
    admin_io = await client.model_io(options.admin_model)
    if admin_io.inputs is not None and "adapter_command" in admin_io.inputs:
        if await serving_admin.load_into_host(client, options.admin_model, names):
            return time.perf_counter() - start, "adapter_command"
    firsts: dict[str, TraceRequest] = {}
    for r in trace.requests:
        if r.adapter is not None and r.adapter not in firsts:  # a short prompt: only the adapter matters
            firsts[r.adapter] = TraceRequest(r.index, 0.0, r.adapter, r.prompt_ids[:8], 1)
    streams = ServingOptions(streams=min(options.preload_concurrency, len(firsts)), progress_interval_s=30.0)
    await _run_unmeasured(client, target, io, list(firsts.values()), streams, 1, text_of)
    return time.perf_counter() - start, "requests"


async def _run_unmeasured(
    client: Any,
    target: Target,
    io: ModelIO,
    requests: list[TraceRequest],
    options: ServingOptions,
    max_tokens: int,
    text_of: TextOf | None,
) -> None:
    """Send `requests` at once, each for `max_tokens` tokens, and wait for them (not measured)."""
    requests = [TraceRequest(i, 0.0, r.adapter, r.prompt_ids, r.output_len) for i, r in enumerate(requests)]
    replay = StreamReplay(client, target, io, requests, options, text_of, _words, max_tokens)
    await replay.run()
    if replay.open:
        raise RuntimeError(f"warm-up: {len(replay.open)} requests did not finish ({replay.stream_errors[:3]})")


async def run_one(
    client: Any,
    spec: RunSpec,
    target: Target,
    options: ServingOptions,
    name: str,
    text_of: TextOf | None,
    count_tokens: Callable[[str], int],
    group: str = "serving",
) -> dict[str, Any]:
    trace = spec.load()
    io = await client.model_io(target.model)
    logger.info("run %s: %s (%d requests, mode %s) -> model %r %s", name, spec.trace_path, len(trace), spec.mode,
                target.model, io)  # fmt: skip
    preload_s, preload_via = 0.0, "off"
    if options.preload:
        preload_s, preload_via = await preload_adapters(client, target, io, trace, options, text_of)
    warm = list(trace.requests[: options.warmup_requests])
    if warm:
        await _run_unmeasured(client, target, io, warm, ServingOptions(streams=1), 8, text_of)
    on_gpu = await serving_admin.count_on_gpu(client, options.admin_model) if preload_via != "requests" else None
    cpu0 = time.process_time()
    replay = StreamReplay(client, target, io, list(trace.requests), options, text_of, count_tokens)
    duration = await replay.run()
    metrics = summarize(list(replay.records.values()), duration, options.window_fraction)
    metrics.update(
        preload_s=preload_s,
        preload_via=preload_via,
        adapters_on_gpu_at_start=on_gpu,
        stream_errors=len(replay.stream_errors),
        first_errors=replay.stream_errors[:3],
        client_cpu_share=(time.process_time() - cpu0) / duration if duration > 0 else None,
    )
    info = {**asdict(options), "mode": spec.mode, "target": asdict(target), "model_io": _io_info(io)}
    return make_run(name, "serving", trace_info(trace, spec.trace_path), info, metrics,
                    group=group, per_request=per_request(list(replay.records.values())))  # fmt: skip


def _io_info(io: ModelIO) -> dict[str, Any]:
    return {"inputs": sorted(io.inputs) if io.inputs else None, "batched": io.batched}


def _words(text: str) -> int:
    return len(text.split())


def load_tokenizer(path: Path | None) -> tuple[TextOf, Callable[[str], int]]:
    """(ids -> prompt text, text -> token count) from a tokenizer directory; word counts without one."""
    if path is None:
        from perf.make_model import ids_to_text

        return ids_to_text, _words
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))

    def text_of(ids: list[int]) -> str:
        return str(tokenizer.decode(ids))

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    return text_of, count


async def amain(args: argparse.Namespace) -> None:
    target = Target(args.model_name or args.target, *_routing(args))
    options = ServingOptions(streams=args.streams, time_limit_s=args.time_limit, warmup_requests=args.warmup_requests,
                             preload=not args.no_preload, server_kernel_backend=args.server_kernel_backend)  # fmt: skip
    text_of, count_tokens = load_tokenizer(args.tokenizer)
    client = Client(args.url)
    try:
        await client.wait_ready(target.model, args.ready_timeout)
        for text in args.runs:
            spec = RunSpec.parse(text)
            name = f"{args.name_prefix}-{target.model}-{spec.trace_path.stem}-{spec.mode}"
            group = f"{args.name_prefix}-{target.model}"
            run = await run_one(client, spec, target, options, name, text_of, count_tokens, group)
            append_runs(args.out, [run])
            logger.info("%s", headline(run))
    finally:
        await client.close()


def _routing(args: argparse.Namespace) -> tuple[str, str, str]:
    preset = Target.named(args.target)
    return (preset.kind, args.adapter_via or preset.adapter_via, args.adapter_key or preset.adapter_key)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="TRACE[@MODE], MODE one of " + ", ".join(MODES))
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC endpoint")
    parser.add_argument("--target", default="slora", choices=("slora", "ensemble"))
    parser.add_argument("--model-name", help="served model name, if not the target's")
    parser.add_argument("--adapter-via", choices=("input", "parameter", "sampling"))
    parser.add_argument("--adapter-key", help="adapter_id or lora_name")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer dir for the text target (default: word-level)")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--time-limit", type=float, default=600.0)
    parser.add_argument("--warmup-requests", type=int, default=8)
    parser.add_argument("--no-preload", action="store_true")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--server-kernel-backend", help="the server's kernel_backend, recorded so that the report "
                        "pairs this run with in-process runs of the same kernels")  # fmt: skip
    parser.add_argument("--name-prefix", default="serving")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
