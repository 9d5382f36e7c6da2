"""Replay traces against the running Triton server over tritonclient's asyncio gRPC streaming.

    python -m perf.bench_serving --headline --out results.json                  # S-LoRA's method, below
    python -m perf.bench_serving --headline --sweep --out results.json          # and TTFT at 50% / 80% of capacity
    python -m perf.bench_serving --url localhost:8001 --target slora --out results.json traces/s1-n2000.jsonl
    python -m perf.bench_serving --target ensemble --tokenizer /tmp/slora-perf/model --out r.json TRACE@base

TRACE[@MODE] as in bench_engine (lora | base | single); the same metrics and results file, kind "serving". All
runs of one call go to the same running server, one after the other (it serves the base model and every adapter at
once, so n = 5, n = 2000 and the base model need no restart).

`--headline`: S-LoRA's benchmark method (its Table 3): long traces (`--duration`, default 120 s; shorter than 60 s
is refused, where the drain of the last requests would weigh in the figure) at a saturating rate (`--rate`,
default 60 req/s: above what one H200 serves of a 7-8B model; a run that did not saturate says so), written under
`--trace-dir`: the `--setting` adapters' trace at the largest of `--num-adapters` (default 2000, then 5), then the
same trace on the base model. Throughput is S-LoRA's (finished / start to last finish), reported with TTFT p50/p99.

`--sweep`: after each run, its measured capacity C (the finish rate while requests arrive, `window_rps`) and two
more runs of the same trace settings at `--loads` x C (default 0.5 and 0.8): TTFT p50 / p99 at 50% and 80% of
capacity. Each such run records `sweep` (role capacity or load, the fraction, C, the run it came from).

Every run's metrics get `roofline` and `roofline_fraction` (perf/roofline.py). The roofline needs the served
model's config.json, its adapters and its engine's batch limits: read from the served `slora` model's parameters
(the paths slora-serve was given, when readable on this machine), each overridable (`--model`, `--adapter-root`,
`--max-num-seqs`, `--max-batch-tokens`); without a readable model folder the runs have none.
Requests are sent when their arrival time comes, over `--streams` bidirectional gRPC streams (round robin), and
every streamed response is timestamped on arrival. Before the clock starts, the trace's adapters are loaded into
the server's host memory with `adapter_command` load requests (as bench_engine preloads them; see
preload_adapters for the fallback), and a few short requests warm the kernels. The client's own CPU use is
reported (`client_cpu_share`): near 1.0, the Python client rather than the server may be the bottleneck; then
give `--clients N`: N processes replay the run on one clock, the requests round robin over them (token ids only),
and the share is the busiest one's.

Targets (see perf/triton_protocol.py): `slora` (token ids in and out) and `ensemble` (text, vLLM-backend I/O;
prompt token ids are rendered with the model's tokenizer, exact with perf/make_model.py's word-level one).
A progress bar of finished requests shows on a terminal (`--no-progress`); a log line every 5 s everywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from perf import roofline, serving_admin
from perf.make_adapters import SETTINGS
from perf.metrics import RequestRecord, per_request, summarize
from perf.results import append_runs, headline, make_run, trace_info
from perf.triton_protocol import ModelIO, StreamState, Target, decode, encode
from perf.workload import MODES, RunSpec, Trace, TraceConfig, TraceRequest, generate_trace, load_trace, save_trace
from slora.client.engine_limits import read_limits
from slora.client.server_ttft import responder_figures, server_ttft
from slora.client.steps import scrape_settled, step_summary

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
    progress_interval_s: float = 5.0  # a log line this often
    progress_bar: bool = False  # a bar of finished requests, on a terminal
    window_fraction: float = 0.25
    metrics_url: str | None = None  # the server's metrics port (host:port): each run's engine steps (client/steps.py)
    start_at: float | None = None  # the replay's clock starts at this time.perf_counter() (None: when it runs)
    clients: int = 1  # processes that replay a run, its requests round robin (perf/tenant_clients.py); tokens only

    def __post_init__(self) -> None:
        if self.streams < 1 or self.preload_concurrency < 1 or self.clients < 1:
            raise ValueError("streams, preload_concurrency and clients must be >= 1")
        for name in ("time_limit_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class Client:
    """What the replay needs from tritonclient (a fake one stands in for it in the tests)."""

    def __init__(self, url: str) -> None:
        import tritonclient.grpc.aio as grpc_aio

        self.url = url
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

    async def model_parameters(self, model: str) -> dict[str, str]:
        """The served model's config.pbtxt parameters (slora-serve writes the engine's options there)."""
        try:
            return parameters_of(await self._grpc.get_model_config(model, as_json=True))
        except Exception as exc:  # not our server, or an older one: the caller does without
            logger.warning("could not read the parameters of model %r (%s)", model, exc)
            return {}

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


def parameters_of(config: dict[str, Any]) -> dict[str, str]:
    """{key: value} of a model config's parameters (Triton's JSON: {key: {"string_value": value}})."""
    config = config.get("config", config)
    return {key: str(value.get("string_value", "")) for key, value in (config.get("parameters") or {}).items()}


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
        self.desc = "replay"
        self._bar: tqdm | None = None

    def _rid(self, r: TraceRequest) -> str:
        return f"r{r.index}"

    def now(self) -> float:
        return time.perf_counter() - self.start

    async def run(self) -> float:
        """Replay; returns the duration (to the last finish, or to when it gave up)."""
        off = None if self.options.progress_bar else True  # None: tqdm's "on a terminal only"
        with tqdm(total=len(self.records), desc=self.desc, unit="req", disable=off, leave=False) as self._bar:
            return await self._run()

    async def _run(self) -> float:
        self.start = time.perf_counter() if self.options.start_at is None else self.options.start_at
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
            queues[self.stream_of(r, i) % len(queues)].put_nowait(self.stream_request(r, rid))
        self._all_sent.set()
        if len(self.open) <= self.unattributed_errors:
            self._done.set()

    def stream_of(self, r: TraceRequest, i: int) -> int:
        """The stream (before `% streams`) that sends the `i`-th request `r`: round robin here."""
        return i

    def stream_request(self, r: TraceRequest, rid: str) -> dict[str, Any]:
        """What the stream sends for `r` (a subclass may add request parameters)."""
        return encode(r, rid, self.target, self.io, self.client.infer_input, self.text_of, self.max_tokens,
                      getattr(self.client, "requested_output", None))  # fmt: skip

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
            self._tick()

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
        self._tick()

    def _tick(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

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
    setup: roofline.Setup | None = None,
) -> dict[str, Any]:
    """One measured replay of `spec` (adapters preloaded and kernels warmed first); its results-file run, with its
    roofline when `setup` is given (computed after the clock)."""
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
    steps_before = scrape_settled(options.metrics_url)  # the warm-up's last steps are published a moment late
    if options.clients > 1:
        result = await _replay_in_processes(client, target, io, list(trace.requests), options)
    else:
        replay = StreamReplay(client, target, io, list(trace.requests), options, text_of, count_tokens)
        replay.desc = name
        result = await measured(replay)
    records, duration, errors = list(result.records.values()), result.duration, result.stream_errors
    steps_after = scrape_settled(options.metrics_url)
    steps = step_summary(steps_before, steps_after)
    metrics = summarize(records, duration, options.window_fraction)
    metrics.update(
        steps=steps,
        server_ttft=server_ttft(steps_before, steps_after),
        responder=responder_figures(steps_before, steps_after, duration),
        preload_s=preload_s,
        preload_via=preload_via,
        adapters_on_gpu_at_start=on_gpu,
        stream_errors=len(errors),
        first_errors=errors[:3],
        client_cpu_share=result.cpu_share,  # the busiest client process's
        **roofline.roofline_metrics(trace, setup, duration),
    )
    info = {**asdict(options), "mode": spec.mode, "target": asdict(target), "model_io": _io_info(io)}
    return make_run(name, "serving", trace_info(trace, spec.trace_path), info, metrics,
                    group=group, per_request=per_request(records))  # fmt: skip


@dataclass
class ReplayResult:
    """One replay, or several on one clock merged (perf/tenant_clients.py): the records of its requests and what its
    replay counted."""

    records: dict[str, RequestRecord]
    open: set[str]
    stream_errors: list[str]
    refusals: dict[str, int]
    settled: int  # refusals that named no request, settled on open requests without a token
    duration: float  # to the last finish, or to when a client gave up
    cpu_share: float | None  # the busiest client's CPU time over the duration (None: a run of no duration)

    @classmethod
    def of(cls, replay: StreamReplay, duration: float, cpu_s: float) -> ReplayResult:
        settle = getattr(replay, "settle", None)
        settled = settle() if settle is not None else 0
        return cls(dict(replay.records), set(replay.open), list(replay.stream_errors),
                   dict(getattr(replay, "refusals", {})), settled, duration,
                   cpu_s / duration if duration > 0 else None)  # fmt: skip

    @classmethod
    def merged(cls, results: list[ReplayResult]) -> ReplayResult:
        refusals: Counter[str] = Counter()
        for r in results:
            refusals.update(r.refusals)
        return cls({rid: rec for r in results for rid, rec in r.records.items()},
                   set().union(*(r.open for r in results)), [e for r in results for e in r.stream_errors],
                   dict(refusals), sum(r.settled for r in results), max(r.duration for r in results),
                   max((r.cpu_share for r in results if r.cpu_share is not None), default=None))  # fmt: skip


async def measured(replay: StreamReplay) -> ReplayResult:
    """`replay` run on this process's event loop, with the CPU time the process spent meanwhile."""
    cpu0 = time.process_time()
    duration = await replay.run()
    return ReplayResult.of(replay, duration, time.process_time() - cpu0)


async def _replay_in_processes(
    client: Any, target: Target, io: ModelIO, requests: list[TraceRequest], options: ServingOptions
) -> ReplayResult:
    """The replay in options.clients processes on one clock, the requests round robin: one Python process reads
    every streamed response, and near saturation it is busy much of the time, so responses (and sends) wait in it."""
    if target.kind != "tokens":
        raise ValueError(f"clients > 1 replays token ids only; the {target.model!r} target sends text")
    from perf.tenant_clients import ClientWorkers, ReplayJob  # it builds on this module's replay

    job = ReplayJob(StreamReplay, client.url, target, io, replace(options, progress_bar=False, clients=1))
    parts = [requests[i :: options.clients] for i in range(options.clients)]
    workers = ClientWorkers(options.clients)
    try:
        return await asyncio.to_thread(workers.replay, job, [part for part in parts if part])
    finally:
        workers.close()


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


# ---- the roofline of the served model -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RooflineOverrides:
    """What the served model's parameters cannot tell (a server on another machine) or should not (a check)."""

    model: Path | None = None
    adapter_root: Path | None = None
    max_num_seqs: int | None = None
    max_batch_tokens: int | None = None
    dtype_bytes: int | None = None


def served_setup(
    parameters: dict[str, str],
    overrides: RooflineOverrides,
    peaks: roofline.Peaks,
    resolved: dict[str, int] | None = None,
) -> roofline.Setup | None:
    """The roofline's Setup of the served model, from its parameters and the overrides; None (logged) when its
    model folder is not readable here. The batch limits: an override, else a number among the parameters, else
    `resolved` (the engine's own, slora_engine_limit: "auto" as it resolved it), else the CPU defaults (logged)."""
    model = overrides.model or _local_dir(parameters.get("model"))
    if model is None or not (model / "config.json").is_file():
        logger.warning("no roofline: the served model's folder (%s) is not readable here; pass --model", model)
        return None
    defaults = roofline.Limits.engine_defaults()
    given = {"max_num_seqs": overrides.max_num_seqs, "max_batch_tokens": overrides.max_batch_tokens}
    limits = roofline.Limits(**{name: _limit(name, value, parameters, resolved or {}, getattr(defaults, name))
                                for name, value in given.items()})  # fmt: skip
    root = overrides.adapter_root or _local_dir(parameters.get("adapter_root"))
    dtype_bytes = overrides.dtype_bytes or served_dtype_bytes(parameters)
    return roofline.setup_for_model_dir(model, root, limits, peaks, dtype_bytes)


def _limit(name: str, override: int | None, parameters: dict[str, str], resolved: dict[str, int], default: int) -> int:
    if override:
        return override
    if parameters.get(name, "").strip().isdigit():
        return int(parameters[name])
    if resolved.get(name):
        return resolved[name]
    logger.warning("the roofline assumes %s = %d (the CPU default): the server says neither its own (no "
                   "slora_engine_limit; pass --metrics-url) nor a number in its parameters; --%s sets it", name,
                   default, name.replace("_", "-"))  # fmt: skip
    return default


def served_limits(metrics_url: str | None) -> dict[str, int]:
    """The served engine's batch limits as it resolved them (client/engine_limits.py); empty without a metrics url
    or when the page cannot be read (logged)."""
    if metrics_url is None:
        return {}
    try:
        return read_limits(metrics_url)
    except OSError as exc:
        logger.warning("the engine's limits not read from %s: %s", metrics_url, exc)
        return {}


def served_dtype_bytes(parameters: dict[str, str]) -> int:
    """Bytes per weight of the served engine: its dtype, or auto's choice (float32 on CPU, bfloat16 on CUDA)."""
    dtype = parameters.get("dtype", "auto")
    if dtype == "auto":
        return 4 if parameters.get("device", "auto") == "cpu" else 2
    return 4 if dtype == "float32" else 2


def _local_dir(text: str | None) -> Path | None:
    return Path(text) if text and Path(text).is_dir() else None


# ---- S-LoRA's method: the headline traces and the rate sweep -----------------------------------------------------

MIN_HEADLINE_S = 60.0  # shorter traces are decided by the drain of their last requests


@dataclass(frozen=True)
class Headline:
    """S-LoRA's Table 3 method: long traces at a saturating rate, every adapter count and the base model served
    by one running server. Trace files are <prefix>n<N>-<rate>rps-<duration>s.jsonl (perf/workload.py)."""

    setting: str = "S1"
    num_adapters: tuple[int, ...] = (2000, 5)
    base: bool = True  # the largest n's trace on the base model too
    rate: float = 60.0
    duration_s: float = 120.0
    cv: float = 1.0
    alpha: float = 1.0
    input_range: tuple[int, int] = (8, 512)
    output_range: tuple[int, int] = (8, 512)
    seed: int = 42
    allow_short: bool = False  # smoke runs only

    def __post_init__(self) -> None:
        if self.setting not in SETTINGS:
            raise ValueError(f"setting must be one of {', '.join(SETTINGS)}, got {self.setting!r}")
        if not self.num_adapters or min(self.num_adapters) < 1:
            raise ValueError(f"num_adapters must be positive counts, got {self.num_adapters}")
        if self.duration_s < MIN_HEADLINE_S and not self.allow_short:
            raise ValueError(f"duration_s must be >= {MIN_HEADLINE_S:g} s for the headline (the drain would decide "
                             f"the figure), got {self.duration_s:g}; --allow-short-traces for a smoke run")  # fmt: skip

    def config(self, n: int, vocab_size: int) -> TraceConfig:
        return TraceConfig(num_adapters=n, alpha=self.alpha, req_rate=self.rate, cv=self.cv,
                           duration=self.duration_s, input_range=self.input_range, output_range=self.output_range,
                           vocab_size=vocab_size, adapter_prefix=SETTINGS[self.setting].prefix,
                           seed=self.seed)  # fmt: skip

    def runs(self, trace_dir: Path, vocab_size: int) -> list[RunSpec]:
        """The headline's runs, largest n first (a fresh server starts it with no adapter resident), then the
        smaller n, then the largest n's trace on the base model; their traces written to `trace_dir`."""
        counts = sorted(set(self.num_adapters), reverse=True)
        paths = [write_trace(self.config(n, vocab_size), trace_dir) for n in counts]
        specs = [RunSpec(path) for path in paths]
        return specs + [RunSpec(paths[0], "base")] if self.base else specs


def trace_name(config: TraceConfig) -> str:
    return f"{config.adapter_prefix}n{config.num_adapters}-{config.req_rate:g}rps-{config.duration:g}s"


def write_trace(config: TraceConfig, trace_dir: Path, name: str | None = None) -> Path:
    """The trace of `config` as a file (the same seed: the same file)."""
    path = trace_dir / f"{name or trace_name(config)}.jsonl"
    save_trace(generate_trace(config), path)
    return path


def capacity_of(run: dict[str, Any]) -> float:
    """A saturated run's capacity: its finish rate while requests arrive (S-LoRA's throughput where unmeasured)."""
    m = run["metrics"]
    return float(m["window_rps"] if m.get("window_rps") else m["throughput_rps"])


def saturated(run: dict[str, Any], margin: float = 0.95) -> bool:
    """Whether the run's finish rate stayed below what was offered (else its capacity is only a lower bound)."""
    return capacity_of(run) < margin * float(run["trace"]["config"]["req_rate"])


def load_runs(spec: RunSpec, capacity_rps: float, loads: tuple[float, ...], trace_dir: Path) -> list[RunSpec]:
    """The sweep's runs after `spec`'s: the same trace settings at each load x capacity (same mode)."""
    config = load_trace(spec.trace_path).config
    specs = []
    for load in loads:
        at = replace(config, req_rate=round(load * capacity_rps, 3))
        specs.append(RunSpec(write_trace(at, trace_dir, f"{spec.trace_path.stem}-at{round(100 * load)}"), spec.mode))
    return specs


@dataclass
class Session:
    """One call's runs against one running server, each appended to the results file as it ends."""

    client: Any
    target: Target
    options: ServingOptions
    text_of: TextOf | None
    count_tokens: Callable[[str], int]
    prefix: str
    out: Path
    setup: roofline.Setup | None = None

    async def run(self, spec: RunSpec, sweep: dict[str, Any] | None = None) -> dict[str, Any]:
        """Measure `spec` and record it (with its sweep role, if any)."""
        run = await self.measure(spec)
        if sweep is not None:
            run["sweep"] = sweep
        self.record(run)
        return run

    async def measure(self, spec: RunSpec) -> dict[str, Any]:
        name = f"{self.prefix}-{self.target.model}-{spec.trace_path.stem}-{spec.mode}"
        group = f"{self.prefix}-{self.target.model}"
        return await run_one(self.client, spec, self.target, self.options, name, self.text_of, self.count_tokens,
                             group, self.setup)  # fmt: skip

    def record(self, run: dict[str, Any]) -> None:
        append_runs(self.out, [run])
        logger.info("%s", headline(run))

    async def sweep(self, spec: RunSpec, loads: tuple[float, ...], trace_dir: Path) -> list[dict[str, Any]]:
        """`spec` as the capacity run, then its loads: TTFT at each fraction of the measured capacity."""
        first = await self.measure(spec)
        capacity, full = capacity_of(first), saturated(first)
        if not full:
            logger.warning("%s did not saturate the server (%.2f req/s finished of %.2f offered): its capacity is a "
                           "lower bound; raise the trace's rate", first["name"], capacity,
                           first["trace"]["config"]["req_rate"])  # fmt: skip
        first["sweep"] = {"role": "capacity", "capacity_rps": capacity, "saturated": full, "loads": list(loads)}
        self.record(first)
        runs = [first]
        for load, at in zip(loads, load_runs(spec, capacity, loads, trace_dir), strict=True):
            sweep = {"role": "load", "load_fraction": load, "capacity_rps": capacity, "capacity_run": first["name"]}
            runs.append(await self.run(at, sweep))
        return runs


async def amain(args: argparse.Namespace) -> None:
    target = Target(args.model_name or args.target, *_routing(args))
    options = ServingOptions(streams=args.streams, time_limit_s=args.time_limit, warmup_requests=args.warmup_requests,
                             preload=not args.no_preload, server_kernel_backend=args.server_kernel_backend,
                             progress_bar=not args.no_progress, metrics_url=args.metrics_url,
                             clients=args.clients)  # fmt: skip
    text_of, count_tokens = load_tokenizer(args.tokenizer)
    client = Client(args.url)
    try:
        await client.wait_ready(target.model, args.ready_timeout)
        parameters = await client.model_parameters(options.admin_model)
        resolved = served_limits(options.metrics_url)
        setup = served_setup(parameters, _overrides(args), roofline.peaks_from_args(args), resolved)
        session = Session(client, target, options, text_of, count_tokens, args.name_prefix, args.out, setup)
        trace_dir = args.trace_dir or args.out.parent / "traces"
        for spec in [RunSpec.parse(text) for text in args.runs] + _headline_runs(args, setup, trace_dir):
            if args.sweep:
                await session.sweep(spec, tuple(args.loads), trace_dir)
            else:
                await session.run(spec)
    finally:
        await client.close()


def _headline_runs(args: argparse.Namespace, setup: roofline.Setup | None, trace_dir: Path) -> list[RunSpec]:
    if not args.headline:
        return []
    vocab = args.vocab_size or (setup.spec.vocab_size if setup is not None else None)
    if vocab is None:
        raise ValueError("--vocab-size is needed: the served model's config.json is not readable here")
    recipe = Headline(setting=args.setting, num_adapters=tuple(args.num_adapters), base=not args.no_base,
                      rate=args.rate, duration_s=args.duration, cv=args.cv, alpha=args.alpha,
                      input_range=tuple(args.input_range), output_range=tuple(args.output_range), seed=args.seed,
                      allow_short=args.allow_short_traces)  # fmt: skip
    return recipe.runs(trace_dir, vocab)


def _overrides(args: argparse.Namespace) -> RooflineOverrides:
    return RooflineOverrides(args.model, args.adapter_root, args.max_num_seqs, args.max_batch_tokens,
                             args.dtype_bytes)  # fmt: skip


def _routing(args: argparse.Namespace) -> tuple[str, str, str]:
    preset = Target.named(args.target)
    return (preset.kind, args.adapter_via or preset.adapter_via, args.adapter_key or preset.adapter_key)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", help="TRACE[@MODE], MODE one of " + ", ".join(MODES))
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC endpoint")
    parser.add_argument("--target", default="slora", choices=("slora", "ensemble"))
    parser.add_argument("--model-name", help="served model name, if not the target's")
    parser.add_argument("--adapter-via", choices=("input", "parameter", "sampling"))
    parser.add_argument("--adapter-key", help="adapter_id or lora_name")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer dir for the text target (default: word-level)")
    parser.add_argument("--streams", type=int, default=1, help="gRPC streams of each client process")
    parser.add_argument("--clients", type=int, default=1, help="client processes, the requests round robin over "
                        "them on one clock (token ids only); see client_cpu_share")  # fmt: skip
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--warmup-requests", type=int, default=8)
    parser.add_argument("--no-preload", action="store_true")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--server-kernel-backend", help="the server's kernel_backend, recorded so that the report "
                        "pairs this run with in-process runs of the same kernels")  # fmt: skip
    parser.add_argument("--metrics-url", help="the server's metrics port (host:port): each run's engine steps by "
                        "kind in its metrics (`steps`)")  # fmt: skip
    parser.add_argument("--name-prefix", default="serving")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (default: on a terminal)")
    parser.add_argument("--out", type=Path, required=True)
    _headline_arguments(parser.add_argument_group("headline and sweep (S-LoRA's method)"))
    _roofline_arguments(parser.add_argument_group("roofline (default: from the served model's parameters)"))
    args = parser.parse_args(argv)
    if not args.runs and not args.headline:
        parser.error("give traces (TRACE[@MODE]), --headline, or both")
    if args.clients < 1:
        parser.error(f"--clients must be >= 1, got {args.clients}")
    if args.clients > 1 and args.target != "slora":
        parser.error(f"--clients {args.clients}: several client processes replay token ids only (--target slora)")
    return args


def _headline_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--headline", action="store_true", help="S-LoRA's long traces (see top)")
    group.add_argument("--setting", choices=sorted(SETTINGS), default="S1", help="the served adapters' setting")
    group.add_argument("--num-adapters", type=int, nargs="+", default=[2000, 5])
    group.add_argument("--no-base", action="store_true", help="no base-model run")
    group.add_argument("--rate", type=float, default=60.0, help="req/s: a saturating one")
    group.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals (>= 60)")
    group.add_argument("--cv", type=float, default=1.0)
    group.add_argument("--alpha", type=float, default=1.0)
    group.add_argument("--input-range", type=int, nargs=2, default=(8, 512))
    group.add_argument("--output-range", type=int, nargs=2, default=(8, 512))
    group.add_argument("--seed", type=int, default=42)
    group.add_argument("--vocab-size", type=int, help="default: the served model's")
    group.add_argument("--allow-short-traces", action="store_true", help="smoke runs: traces under 60 s")
    group.add_argument("--trace-dir", type=Path, help="where generated traces go (default: traces/ beside --out)")
    group.add_argument("--sweep", action="store_true", help="after each run, TTFT at --loads of its capacity")
    group.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.8], help="fractions of capacity")


def _roofline_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--model", type=Path, help="the served model's folder (config.json)")
    group.add_argument("--adapter-root", type=Path, help="the served adapters' folder")
    group.add_argument("--max-num-seqs", type=int, help="the server's max_num_seqs")
    group.add_argument("--max-batch-tokens", type=int, help="the server's max_batch_tokens")
    group.add_argument("--dtype-bytes", type=int, help="bytes per weight element of the server")
    roofline.add_peak_arguments(group)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
