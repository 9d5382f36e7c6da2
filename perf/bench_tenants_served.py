"""Tenant isolation served through Triton: the noisy neighbour and overload suites of perf/tenant_suites.py,
replayed over gRPC streams against `slora-serve`, as users send their requests.

    python -m perf.bench_tenants_served --smoke --out /tmp/tenants-served.json     # default model on CPU, ~2-3 min
    python -m perf.bench_tenants_served --out results.json -- --model /tmp/slora-perf/model \\
        --adapter-dir /tmp/slora-perf/adapters/S1 --device cuda --engine-option load_format=dummy
    python -m perf.bench_tenants_served --url localhost:8001 --capacity 36 --out results.json   # a running server

Everything after `--` is given to slora-serve, which this benchmark starts once per server-wide configuration
the suites need, one after the other on free local ports: fcfs (the capacity burst, fcfs' runs), fair, priority,
early abort (fcfs with `--engine-option ttft_slo_s=<slo> --engine-option early_abort=true`). Each server gets the
tenants' adapters into host memory (`adapter_command` loads) and a few waves of warm-up requests before its runs;
its log goes to `--server-log-dir`. With `--url` the benchmark runs against that one running server instead:
its configuration is read from its `slora` model's parameters, and only the runs of that configuration are made
(the capacity is measured on it by the burst, or given with `--capacity`, e.g. from an fcfs server's run; an
early-abort server would refuse the burst).

Requests are the traces of tenant_suites, sent at their arrival times by bench_serving's StreamReplay to the
`slora` model (token ids), each with its request parameters `adapter_id` (its adapter) and `tenant` (its tenant:
the adapter's name, as the in-process runs count it). As separate customers would send them, each tenant has a
stream of its own (`--streams 0`), and the replay runs in `--clients` processes on one clock, the heavy tenants
apart (perf/tenant_clients.py says why). A request the server refuses for its SLO (UNAVAILABLE, a
message naming ttft_slo_s or queue_timeout_s) is recorded as refused (finish reason "rejected"), attributed by the
request id the message names; other errors are errors. Every replay is a run of kind "served", group "tenants",
with the in-process runs' metrics (`tenants`, `service_gap`, `slo`, `refusals` by reason, `vs_without`, `load`,
`goodput_over_capacity`), `stream_errors`, `steps` (the server's engine steps during the run by kind, from its
metrics port: client/steps.py), and in its options the server's engine configuration as its parameters give
it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from perf import serving_admin
from perf.bench_serving import Client, ReplayResult, ServingOptions, StreamReplay, measured
from perf.results import append_runs, headline, make_run, trace_info
from perf.serve_process import ServeProcess
from perf.tenant_clients import (
    ClientWorkers,
    ReplayJob,
    assign_clients,
    count_words,
    tenant_of_request,
)
from perf.tenant_suites import (
    MODES,
    POLICIES,
    REASONS,
    BenchOptions,
    Replayed,
    add_plan_arguments,
    burst_trace,
    measure_capacity,
    plan_from_args,
    run_suites,
    tenant_metrics,
)
from perf.triton_protocol import ModelIO, Target
from perf.workload import Trace, TraceRequest
from slora.backend.config import EngineConfig
from slora.client.server_ttft import responder_figures, server_ttft, server_ttft_by_tenant
from slora.client.steps import scrape_settled, step_summary

logger = logging.getLogger(__name__)

TARGET = Target("slora", "tokens", "parameter", "adapter_id")  # the adapter as a request parameter
WARMUP_TOKENS = 8
# A CPU server on a small shared machine: spinning intra-op threads make its steps many times slower and erratic.
SMOKE_ENV = (("OMP_NUM_THREADS", "1"),)
SMOKE_TIME_LIMIT_S = 120.0  # the capacity burst takes tens of seconds through a CPU server
_REFUSED = re.compile(r"request '(?P<id>[^']*)' refused: (?P<why>.*)", re.DOTALL)


# ---- refusals ------------------------------------------------------------------------------------------------------


def parse_refusal(message: str) -> tuple[str | None, str] | None:
    """(the client's request id, or None where the message names none; the reason, one of REASONS) of an SLO
    refusal's error message, None for any other error. The server names a request `<client id>-<n>`."""
    if "refused: queue_timeout_s=" in message:
        reason = "queue_timeout"
    elif "refused: its first token cannot come within ttft_slo_s=" in message:
        reason = "ttft_slo_early" if "at the measured rates" in message else "ttft_slo"
    else:
        return None
    match = _REFUSED.search(message)
    if match is None:
        return None, reason
    served_id = match["id"]
    client_id, _, counter = served_id.rpartition("-")
    return (client_id if client_id and counter.isdigit() else served_id), reason


class TenantReplay(StreamReplay):
    """bench_serving's replay with each request's tenant in its parameters, and SLO refusals counted as refused."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refusals = dict.fromkeys(REASONS, 0)
        self.unattributed_refusals = 0
        tenants = sorted({tenant_of_request(r) for r in self.requests})
        self._stream_of_tenant = {tenant: i for i, tenant in enumerate(tenants)}

    def stream_of(self, r: TraceRequest, i: int) -> int:
        """A tenant's requests share its stream, as one customer's client would send them: with a stream a tenant,
        no tenant's responses queue behind another's on the way back (one stream's responses go out one by one)."""
        return self._stream_of_tenant[tenant_of_request(r)]

    def stream_request(self, r: TraceRequest, rid: str) -> dict[str, Any]:
        request = super().stream_request(r, rid)
        request["parameters"] = {**(request.get("parameters") or {}), "tenant": tenant_of_request(r)}
        return request

    def _on_error(self, result: Any, error: Any) -> None:
        refusal = parse_refusal(str(error))
        if refusal is None:
            super()._on_error(result, error)
            return
        rid, reason = refusal
        self.refusals[reason] += 1
        if rid in self.open:
            self.records[rid].finish(self.now(), "rejected", str(error))
            self.open.discard(rid)
        else:  # counted like bench_serving's unattributed errors, so that the replay still ends
            self.unattributed_errors += 1
            self.unattributed_refusals += 1
        self._tick()

    def settle(self) -> int:
        """After the run: refusals whose message named no request of ours go to the open requests that got no
        token (the refused ones, if nothing else went wrong), earliest first; returns how many were settled so."""
        silent = sorted((rid for rid in self.open if not self.records[rid].chunk_times),
                        key=lambda rid: self.records[rid].arrival)  # fmt: skip
        settled = silent[: self.unattributed_refusals]
        for rid in settled:
            self.records[rid].finish(self.now(), "rejected", "refused for its SLO (the message named no request)")
            self.open.discard(rid)
        if settled:
            logger.warning("%d refusals named no request; counted for the open requests without a token", len(settled))
        return len(settled)


# ---- the server's configuration --------------------------------------------------------------------------------


def add_server_ttfts(tenants: dict[str, dict[str, Any]], by_tenant: dict[str, dict[str, float | None]]) -> None:
    """Each tenant's first-token p50 / p90 as the server measured them (its tenant histograms, interpolated in
    10 ms buckets) beside the client's: their difference is the tenant's path outside the engine."""
    for tenant, figures in tenants.items():
        server = by_tenant.get(tenant) or {}
        figures["server_ttft_p50_s"] = server.get("p50_s")
        figures["server_ttft_p90_s"] = server.get("p90_s")


def served_engine(parameters: dict[str, str]) -> EngineConfig:
    """The server's EngineConfig as its `slora` parameters give it (options it was not given: their defaults)."""
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig.from_dict({k: v for k, v in parameters.items() if k in known})


def configuration_of(engine: EngineConfig) -> str:
    """The suites' name of a server's configuration: early-abort (fcfs with an SLO and early abort), or its policy."""
    if engine.scheduling_policy == "fcfs" and engine.ttft_slo_s is not None and engine.early_abort:
        return "early-abort"
    return engine.scheduling_policy


def matches(engine: EngineConfig, changes: dict[str, Any]) -> bool:
    return all(getattr(engine, key) == value for key, value in changes.items())


def engine_option_args(changes: dict[str, Any]) -> list[str]:
    """slora-serve flags for EngineConfig changes."""
    args = []
    for key, value in changes.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        args += ["--engine-option", f"{key}={text}"]
    return args


def model_vocab_size(parameters: dict[str, str]) -> int | None:
    """The served model's vocabulary size, where its config.json is readable here."""
    config = Path(parameters.get("model", "")) / "config.json"
    if not parameters.get("model") or not config.is_file():
        return None
    data = json.loads(config.read_text())
    size = data.get("vocab_size") or data.get("text_config", {}).get("vocab_size")
    return int(size) if size else None


# ---- the bench -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServedSetup:
    """Where the runs are served: slora-serve started with `serve_args` per configuration, or the server at `url`."""

    serve_args: tuple[str, ...] = ()
    url: str | None = None
    log_dir: Path = Path("tenants-served-logs")
    vocab_size: int | None = None  # default: the served model's
    streams: int = 0  # gRPC streams of a client; 0: one a tenant
    clients: int = 3  # client processes of a run: the heavy tenants in one, the others shared by the rest
    ready_timeout_s: float = 900.0
    env: tuple[tuple[str, str], ...] = ()  # added to the servers' environment
    metrics_url: str | None = None  # the --url server's metrics port (host:port), for each run's steps


@dataclass
class _Served:
    """The server of the current configuration, as this client sees it."""

    client: Client
    url: str
    parameters: dict[str, str]
    engine: EngineConfig
    io: ModelIO


class ServedBench:
    """The suites' TenantBench through Triton: one server per configuration (or the one at `url`), one event loop
    for every call (tritonclient's aio client belongs to the loop it was made in)."""

    prefix = "tenants-served"

    def __init__(self, options: BenchOptions, adapters: list[str], setup: ServedSetup) -> None:
        self.options = options
        self.adapters = adapters
        self.setup = setup
        self._loop = asyncio.new_event_loop()
        self._process: ServeProcess | None = None
        self._served: _Served | None = None
        self._changes: dict[str, Any] | None = None
        self._vocab_size = setup.vocab_size
        self._workers: ClientWorkers | None = None

    @property
    def vocab_size(self) -> int:
        if self._vocab_size is None:
            raise ValueError("the served model's config.json is not readable here: give --vocab-size")
        return self._vocab_size

    def replay_job(self, served: _Served) -> ReplayJob:
        options = ServingOptions(streams=self.setup.streams or 1, time_limit_s=self.options.time_limit_s,
                                 progress_bar=self.options.progress and self.setup.clients == 1)  # fmt: skip
        return ReplayJob(TenantReplay, served.url, TARGET, served.io, options, stream_a_tenant=self.setup.streams == 0)

    # -- servers --

    def connect(self) -> EngineConfig:
        """The server at `url`, ready; returns its configuration."""
        if self.setup.url is None:
            raise ValueError("connect() is for a server given by url")
        self._served = self._run(self._connect(self.setup.url))
        return self._served.engine

    def prepare(self, changes: dict[str, Any]) -> None:
        if self.setup.url is not None:
            served = self._served or self._run(self._connect(self.setup.url))
            self._served = served
            if not matches(served.engine, changes):
                raise ValueError(f"the server at {self.setup.url} runs {configuration_of(served.engine)}; these "
                                 f"runs need {changes}")  # fmt: skip
            return
        if self._changes == changes and self._served is not None:
            return
        self.close_server()
        name = "early-abort" if changes.get("ttft_slo_s") is not None else changes.get("scheduling_policy", "fcfs")
        log = self.setup.log_dir / f"slora-serve-{name}.log"
        args = [*self.setup.serve_args, *engine_option_args(changes)]
        self._process = ServeProcess(args, log, self.setup.ready_timeout_s, env=dict(self.setup.env)).start()
        self._served = self._run(self._connect(self._process.grpc_url))
        self._changes = dict(changes)

    async def _connect(self, url: str) -> _Served:
        client = Client(url)
        await client.wait_ready(TARGET.model, self.setup.ready_timeout_s)
        parameters = await client.model_parameters(TARGET.model)
        served = _Served(client, url, parameters, served_engine(parameters), await client.model_io(TARGET.model))
        self._vocab_size = self._vocab_size or model_vocab_size(parameters)
        await self._get_ready(served)
        return served

    async def _get_ready(self, served: _Served) -> None:
        """The tenants' adapters into host memory, then warm-up waves (unmeasured), as the in-process engine gets."""
        started = time.perf_counter()
        if not await serving_admin.load_into_host(served.client, TARGET.model, self.adapters):
            logger.warning("the adapters were not all loaded ahead; the first requests will read them")
        warm = burst_trace(self.adapters, self.options, 99, self.vocab_size).requests
        limit = served.engine.max_num_seqs or max(self.options.warmup_requests, default=0)
        for size in self.options.warmup_requests:
            wave = [replace(warm[i % len(warm)], index=i, arrival=0.0) for i in range(min(size, limit))]
            replay = TenantReplay(served.client, TARGET, served.io, wave, ServingOptions(streams=1), None, count_words,
                                  WARMUP_TOKENS)  # fmt: skip
            await replay.run()
            if replay.open or replay.stream_errors:
                logger.warning("warm-up wave of %d: %d open, errors %s", size, len(replay.open),
                               replay.stream_errors[:2])  # fmt: skip
        logger.info("server %s ready for the runs in %.1fs (adapters loaded, warm-up waves %s)", served.url,
                    time.perf_counter() - started, self.options.warmup_requests)  # fmt: skip

    def close_server(self) -> None:
        if self._served is not None:
            self._run(self._served.client.close())
            self._served = None
        if self._process is not None:
            self._process.stop()
            self._process = None
        self._changes = None

    def close(self) -> None:
        try:
            self.close_server()
        finally:
            if self._workers is not None:
                self._workers.close()
            self._loop.close()

    def _run(self, coroutine: Any) -> Any:
        return self._loop.run_until_complete(coroutine)

    # -- runs --

    def replay(self, name: str, trace: Trace, changes: dict[str, Any], window_s: float | None = None) -> Replayed:
        """Replay `trace` on the server of `changes`; per-tenant throughput over [0, window_s] (default: the run)."""
        self.prepare(changes)
        served = self._served
        assert served is not None
        steps_before = scrape_settled(self._metrics_url())
        result = self._replay_clients(served, list(trace.requests), name)
        steps_after = scrape_settled(self._metrics_url())
        steps = step_summary(steps_before, steps_after)
        records = list(result.records.values())
        costs = (served.engine.fair_prompt_cost, served.engine.fair_output_cost)
        duration = result.duration
        metrics = tenant_metrics(records, duration, window_s or duration, self.options, costs)
        metrics.update(refusals=result.refusals, refusals_unattributed=result.settled,
                       stream_errors=len(result.stream_errors), first_errors=result.stream_errors[:3],
                       client_cpu_share=result.cpu_share, steps=steps,
                       server_ttft=server_ttft(steps_before, steps_after),
                       responder=responder_figures(steps_before, steps_after, duration))  # fmt: skip
        add_server_ttfts(metrics["tenants"], server_ttft_by_tenant(steps_before, steps_after))
        run = make_run(name, "served", trace_info(trace), self._run_options(served, changes), metrics,
                       group="tenants")  # fmt: skip
        logger.info("%s | service gap %.0f | slo %s", headline(run), metrics["service_gap"], metrics["slo"])
        return Replayed(name, trace, records, duration, run)

    def _replay_clients(self, served: _Served, requests: list[TraceRequest], name: str) -> ReplayResult:
        """The requests replayed by setup.clients client processes (assign_clients), or by this process's loop."""
        job = self.replay_job(served)
        parts = assign_clients(requests, self.setup.clients)
        if len(parts) <= 1:
            replay = TenantReplay(served.client, TARGET, served.io, requests, job.options_for(requests, None), None,
                                  count_words)  # fmt: skip
            replay.desc = name
            return self._run(measured(replay))
        if self._workers is None:
            self._workers = ClientWorkers(self.setup.clients)
        logger.info("%s: %d client processes, %s requests each", name, len(parts), [len(p) for p in parts])
        return self._workers.replay(job, parts)

    def _metrics_url(self) -> str | None:
        return self._process.metrics_url if self._process is not None else self.setup.metrics_url

    def _run_options(self, served: _Served, changes: dict[str, Any]) -> dict[str, Any]:
        server = {"url": served.url, "started_here": self.setup.url is None, "serve_args": list(self.setup.serve_args),
                  "streams": self.setup.streams or "one a tenant", "client_processes": self.setup.clients}  # fmt: skip
        return {**asdict(self.options), "mode": "lora", "engine_changes": changes, "engine": asdict(served.engine),
                "target": asdict(TARGET), "server": server}  # fmt: skip


# ---- running ---------------------------------------------------------------------------------------------------


def run(options: BenchOptions, adapters: list[str], setup: ServedSetup, out: Path, suites: tuple[str, ...],
        capacity: float | None = None) -> None:  # fmt: skip
    """The suites, each configuration on its own server (or, with setup.url, the running server's runs only)."""
    bench = ServedBench(options, adapters, setup)
    try:
        if setup.url is not None:
            capacity = _on_running_server(bench, out, capacity)
        run_suites(bench, out, suites, capacity)
    finally:
        bench.close()


def _on_running_server(bench: ServedBench, out: Path, capacity: float | None) -> float:
    """Narrow the plan to the running server's configuration; its capacity, given or measured by the burst."""
    engine = bench.connect()
    name = configuration_of(engine)
    o = bench.options
    bench.options = replace(o, policies=(name,) if name in POLICIES else (), modes=(name,) if name in MODES else (),
                            slo_s=engine.ttft_slo_s or o.slo_s)  # fmt: skip
    logger.info("the server at %s runs %s: its runs only (policies %s, modes %s)", bench.setup.url, name,
                bench.options.policies, bench.options.modes)  # fmt: skip
    if capacity is not None:
        return capacity
    if engine.ttft_slo_s is not None:
        raise ValueError("the server refuses requests for their SLO, so its burst measures no capacity: give "
                         "--capacity (e.g. the capacity run of an fcfs server)")  # fmt: skip
    done = measure_capacity(bench, {"scheduling_policy": engine.scheduling_policy})
    append_runs(out, [done.run])
    return float(done.run["metrics"]["capacity_rps"])


# ---- command line ----------------------------------------------------------------------------------------------


def smoke_serve_args(root: Path, tenants: int) -> list[str]:
    """slora-serve of the default model on CPU, with S1 adapters of its shapes (tenants + 1) under `root`, and few
    batch slots so that a tiny overload queues."""
    from perf.make_adapters import SETTINGS, make_adapters
    from slora.backend.model.default_model import resolve_model_path

    model = resolve_model_path("default")
    make_adapters(model, SETTINGS["S1"], n=tenants + 1, out=root / "adapters", distinct=2, progress=False)
    return ["--model", "default", "--device", "cpu", "--adapter-dir", str(root / "adapters"), "--max-num-seqs", "8",
            "--max-model-len", "512"]  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="short runs (SMOKE) on the default model on CPU, or "
                        "on the --url server")  # fmt: skip
    parser.add_argument("--url", help="a running server's gRPC endpoint: its configuration's runs only")
    parser.add_argument("--metrics-url", help="with --url: that server's metrics port (host:port), for each run's "
                        "engine steps (servers started here are scraped anyway)")  # fmt: skip
    parser.add_argument("--capacity", type=float, help="req/s, instead of measuring it (e.g. with --url)")
    parser.add_argument("--adapter-prefix", default="s1-", help="adapters <prefix><index:04d>, tenants + 1 of them")
    parser.add_argument("--vocab-size", type=int, help="default: the served model's config.json")
    parser.add_argument(
        "--streams",
        type=int,
        default=0,
        help="gRPC streams of each client process, the requests "
        "round robin over them; 0 (default): one stream a tenant, as each tenant's client would have",
    )
    parser.add_argument("--clients", type=int, default=3, help="client processes of a run: the heavy tenants in one, "
                        "the others shared round robin by the rest, so that no tenant's first tokens wait in the "
                        "client behind the noisy tenant's responses (1: one process, this one)")  # fmt: skip
    parser.add_argument("--server-log-dir", type=Path, help="slora-serve logs (default: beside --out)")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds a server may take to start")
    add_plan_arguments(parser)
    args = parser.parse_args(own)
    args.serve_args = serve_args
    if args.url is None and not args.smoke and not serve_args:
        parser.error("give slora-serve's options after `--`, --url of a running server, or --smoke")
    if args.url is not None and serve_args:
        parser.error("--url runs against a running server: no slora-serve options")
    if args.clients < 1 or args.streams < 0:
        parser.error(f"--clients must be >= 1 and --streams >= 0, got {args.clients} and {args.streams}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    options, suites = plan_from_args(args)
    if args.smoke and args.time_limit is None:
        options = replace(options, time_limit_s=SMOKE_TIME_LIMIT_S)
    log_dir = args.server_log_dir or args.out.parent / f"{args.out.stem}-servers"
    setup = ServedSetup(tuple(args.serve_args), args.url, log_dir, args.vocab_size, args.streams, args.clients,
                        args.ready_timeout, metrics_url=args.metrics_url)  # fmt: skip
    adapters = [f"{args.adapter_prefix}{i:04d}" for i in range(options.tenants + 1)]
    if args.smoke and args.url is None:
        with tempfile.TemporaryDirectory(prefix="slora-tenants-served-") as tmp:
            serve_args = (*smoke_serve_args(Path(tmp), options.tenants), *args.serve_args)
            setup = replace(setup, serve_args=serve_args, env=SMOKE_ENV)
            run(options, adapters, setup, args.out, suites, args.capacity)
        return
    run(options, adapters, setup, args.out, suites, args.capacity)


if __name__ == "__main__":
    main()
