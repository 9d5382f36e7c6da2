"""Replay traces against the engine in this process (no server): the in-process side of every comparison.

    python -m perf.bench_engine --model /tmp/slora-perf/model --adapter-root /tmp/slora-perf/adapters/S1 \\
        --load-format dummy --kernel-backend triton --out results.json \\
        traces/s1-n5.jsonl traces/s1-n2000.jsonl traces/s1-n2000.jsonl@base traces/s1-n2000.jsonl@single

Each positional argument is TRACE[@MODE] (perf/workload.py: lora, base, single), run one after the other on the
same engine.

Requests are added when their arrival time comes, between steps, as a server's engine thread would; their
latency counts from the scheduled arrival. Before the clock starts, the trace's adapters are read into host
memory (S-LoRA keeps every adapter in host memory too; the time is reported as `preload_s`), a few requests
warm up the kernels, and the pool is emptied of adapters so that each run starts cold on the GPU. A request whose
adapter is not in host memory then (more adapters than the host budget holds) has it read on an intake thread, as
the server does, while the steps go on (perf/replay_intake.py).

Each run's metrics get `roofline` and `roofline_fraction` (perf/roofline.py: the least time the GPU needs for the
trace under this engine's max_num_seqs and max_batch_tokens, and the share of it the run reached), computed after
the clock; `--peaks` / `--hbm-tb-s` / `--peak-tflops` choose the GPU's figures (default: the datasheet of the
GPU that runs).
A progress bar of finished requests shows on a terminal (`--no-progress`), a log line every 5 s everywhere.

`--profile START... COUNT` adds, after the measured runs, one unmeasured pass over the last run's trace that uses
adapters (its first 256 requests, all at once, so the batch is full): from each step START, COUNT steps under
torch.profiler (operators by device time; device-busy share of the wall time), the next COUNT under cProfile
(host functions), into `--profile-file`: where the time of a step goes, without disturbing any measured run.

`--profile-replay START COUNT` profiles steps as the measured runs had them instead: after the runs, the last run
that uses adapters and the last base-model run are each replayed once more in real time (unmeasured, adapters
cold on the GPU), with COUNT steps from step START under torch.profiler, then COUNT under cProfile: decode and
mixed steps of the trace's own batches, the LoRA run's next to the base model's. Each torch.profiler window also
gets a table of its steps' timelines (perf/trace_steps.py: host time against the device's busy and idle time);
`--profile-trace-dir` keeps the chrome traces too.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from perf import roofline
from perf.metrics import RequestRecord, per_request, summarize
from perf.replay_intake import ReplayIntake
from perf.results import append_runs, headline, make_run, trace_info
from perf.step_profiler import StepProfiler
from perf.workload import MODES, RunSpec, Trace, TraceRequest
from slora.backend.config import EngineConfig, parse_size
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.request import Request
from slora.backend.errors import EngineOverloadedError, SloraError
from slora.backend.executor.model_runner import PHASES, StepShape
from slora.backend.runtime.gc_freeze import startup_objects_frozen
from slora.backend.runtime.gc_pauses import between as gc_between
from slora.backend.runtime.gc_threshold import young_threshold_raised
from slora.kernels.triton.jit_stats import keys_since, variant_keys

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplayOptions:
    time_limit_s: float = 600.0  # requests still running then are aborted and count as unfinished
    # Warm-up waves of this many requests each (the trace's, cycled): Triton compiles a kernel variant per launch
    # shape class (tile counts, K splits), so the waves cover batch sizes up to a full one before the clock.
    warmup_requests: tuple[int, ...] = (8, 64, 256)
    warmup_tokens: int = 8
    preload: bool = True
    preload_workers: int | None = None  # the store's default: one per core, at most 8
    progress_interval_s: float = 5.0  # a log line this often
    progress_bar: bool = False  # a bar of finished requests, on a terminal
    window_fraction: float = 0.25

    def __post_init__(self) -> None:
        if not self.time_limit_s > 0:
            raise ValueError(f"time_limit_s must be > 0, got {self.time_limit_s}")
        if self.warmup_tokens < 0:
            raise ValueError(f"warmup_tokens must be >= 0, got {self.warmup_tokens}")
        if self.preload_workers is not None and self.preload_workers < 1:
            raise ValueError(f"preload_workers must be >= 1, got {self.preload_workers}")
        if any(n < 0 for n in self.warmup_requests):
            raise ValueError(f"warmup_requests must be >= 0, got {self.warmup_requests}")
        if not 0.0 <= self.window_fraction < 1.0:
            raise ValueError(f"window_fraction must be in [0, 1), got {self.window_fraction}")


def preload_adapters(engine: LLMEngine, names: list[str], workers: int | None) -> float:
    """Read adapters into the host store as the server's preload does (threads of one intra-op thread each;
    default: one per core, at most 8); returns seconds."""
    start = time.perf_counter()
    if names:
        engine.store.preload(workers, names)
    loaded = sum(1 for a in engine.store.list() if a.in_host and a.name in set(names))
    if loaded < len(names):
        logger.warning("only %d of %d adapters fit in the host budget (%d bytes); the rest reload from disk",
                       loaded, len(names), engine.store.budget_bytes)  # fmt: skip
    return time.perf_counter() - start


def warm_up(engine: LLMEngine, trace: Trace, options: ReplayOptions) -> None:
    """Compile and warm the kernels on waves of the trace's requests (prompts, mixed and decode steps of every
    batch size class, LoRA); not measured. Waves are capped at the engine's max_num_seqs."""
    if not trace.requests or options.warmup_tokens == 0:
        return
    start = time.perf_counter()
    for size in options.warmup_requests:
        size = min(size, engine.config.max_num_seqs)
        requests = [trace.requests[i % len(trace.requests)] for i in range(size)]
        sampling = [{**r.sampling(), "max_tokens": min(r.output_len, options.warmup_tokens)} for r in requests]
        engine.generate([list(r.prompt_ids) for r in requests], [r.adapter for r in requests], sampling)
    logger.info("warm-up: waves of %s requests in %.1fs", options.warmup_requests, time.perf_counter() - start)


@dataclass
class StepTally:
    """Steps of one kind (graph, eager decode, mixed): how many, their time, their sequences and tokens."""

    steps: int = 0
    seconds: float = 0.0
    seqs: int = 0
    tokens: int = 0
    phases: list[float] = field(default_factory=lambda: [0.0] * len(PHASES))  # seconds of each runner phase

    def add(self, seconds: float, shape: StepShape) -> None:
        self.steps += 1
        self.seconds += seconds
        self.seqs += shape.num_seqs
        self.tokens += shape.num_tokens
        self.phases = [total + s for total, s in zip(self.phases, shape.phases, strict=True)]

    def summary(self) -> dict[str, float]:
        """Means per step; `other_ms` is the step's time outside the runner (scheduling, outputs)."""
        n = max(self.steps, 1)
        means = {f"{name}_ms": 1000 * total / n for name, total in zip(PHASES, self.phases, strict=True)}
        other = 1000 * (self.seconds - sum(self.phases)) / n
        return {"steps": self.steps, "seconds": self.seconds, "mean_ms": 1000 * self.seconds / n,
                "mean_seqs": self.seqs / n, "mean_tokens": self.tokens / n, **means, "other_ms": other}  # fmt: skip


class Replay:
    """Feeds one trace to the engine in real time and records every request's timings."""

    def __init__(
        self,
        engine: LLMEngine,
        trace: Trace,
        options: ReplayOptions,
        profiler: StepProfiler | None = None,
        desc: str = "replay",
    ) -> None:
        self.engine = engine
        self.options = options
        self.profiler = profiler  # an unmeasured replay's profiled steps (--profile-replay)
        self.pending: deque[TraceRequest] = deque(trace.requests)
        self.records = {
            f"r{r.index}": RequestRecord(r.index, r.adapter, r.input_len, r.output_len, r.arrival)
            for r in trace.requests
        }
        self.open: set[str] = set()
        self.intake = ReplayIntake(engine)  # requests whose adapter is read from disk, as a server's intake does
        self.prepared: deque[Request] = deque()  # prepared, waiting to be queued in the engine
        self.cold_requests = 0  # requests that waited for their adapter's read from disk
        self.kinds: dict[str, StepTally] = {}  # steps by kind (graph, eager decode, mixed)
        self.refusals = 0
        self.start = 0.0
        self.desc = desc

    def now(self) -> float:
        return time.perf_counter() - self.start

    @property
    def steps(self) -> int:
        return sum(tally.steps for tally in self.kinds.values())

    @property
    def step_time(self) -> float:
        return sum(tally.seconds for tally in self.kinds.values())

    def run(self) -> float:
        """Replay until every request finished or the time limit; returns the duration (to the last finish)."""
        off = None if self.options.progress_bar else True  # None: tqdm's "on a terminal only"
        try:
            with tqdm(total=len(self.records), desc=self.desc, unit="req", disable=off, leave=False) as bar:
                return self._run(bar)
        finally:
            self.intake.close()

    def _run(self, bar: tqdm) -> float:
        self.start = time.perf_counter()
        last_log = 0.0
        last_event = 0.0
        while self.pending or self.open:
            now = self.now()
            if now > self.options.time_limit_s:
                self._abort_all()
                return now
            self._add_arrived(now)
            self._submit_prepared()
            if self.engine.has_unfinished():
                last_event = self._step() or last_event
            else:
                self._idle()
            bar.update(len(self.records) - len(self.pending) - len(self.open) - bar.n)
            if now - last_log >= self.options.progress_interval_s:
                self._progress(now)
                last_log = now
        return last_event

    def _idle(self) -> None:
        """Nothing to step: until the next arrival or the next adapter read, 50 ms at most."""
        timeout = min(max(self.pending[0].arrival - self.now(), 0.0), 0.05) if self.pending else 0.05
        if len(self.intake):
            self.intake.wait(timeout)
        elif self.pending:
            time.sleep(timeout)

    def _add_arrived(self, now: float) -> None:
        """Prepare the requests that have arrived: here, or on an intake thread when their adapter must be read from
        disk first; _submit_prepared queues them in the engine."""
        while self.pending and self.pending[0].arrival <= now:
            r = self.pending.popleft()
            rid = f"r{r.index}"
            self.open.add(rid)
            if r.adapter and self.intake.is_cold(r.adapter):
                self.intake.start(rid, r.prompt_ids, r.adapter, r.sampling())
                self.cold_requests += 1
                continue
            try:
                # Token ids only, as S-LoRA's benchmark and the served `slora` model: no text is decoded.
                request = self.engine.prepare(list(r.prompt_ids), r.adapter, r.sampling(), rid, detokenize=False)
            except SloraError as exc:
                self._refused(rid, exc)
            else:
                self.prepared.append(request)

    def _submit_prepared(self) -> None:
        """Queue the prepared requests in the engine, with those whose adapter the intake has read since; record the
        errors of those that could not be taken. A full queue leaves the rest for after the next step."""
        for rid, result in self.intake.ready():
            if isinstance(result, Request):
                self.prepared.append(result)
            else:
                self._refused(rid, result)
        while self.prepared:
            try:
                self.engine.submit(self.prepared[0])
            except EngineOverloadedError:
                self.refusals += 1
                return  # queue full: retry after the next step
            except SloraError as exc:
                self._refused(self.prepared[0].request_id, exc)
            self.prepared.popleft()

    def _refused(self, rid: str, error: BaseException) -> None:
        self.records[rid].finish(self.now(), "error", str(error))
        self.open.discard(rid)
        logger.warning("request %s refused: %s", rid, error)

    def _step(self) -> float | None:
        if self.profiler is not None:
            self.profiler.before_step()
        began = time.perf_counter()
        outputs = self.engine.step()
        elapsed = time.perf_counter() - began
        if self.profiler is not None:
            self.profiler.after_step()
        shape = self.engine.runner.last_step
        self.kinds.setdefault(shape.kind, StepTally()).add(elapsed, shape)
        t = self.now()
        finished_any = None
        for out in outputs:
            record = self.records.get(out.request_id)
            if record is None:
                continue
            record.add_chunk(t, len(out.new_token_ids))
            if out.finished:
                record.finish(t, out.finish_reason, out.error)
                self.open.discard(out.request_id)
                finished_any = t
        return finished_any

    def _abort_all(self) -> None:
        logger.warning("time limit of %.0fs reached: aborting %d running (%d of them reading their adapter) and %d "
                       "unsent requests", self.options.time_limit_s, len(self.open), len(self.intake),
                       len(self.pending))  # fmt: skip
        for rid in list(self.open):
            self.engine.abort(rid)
        self.open.clear()
        self.pending.clear()
        self.prepared.clear()

    def _progress(self, now: float) -> None:
        done = sum(1 for r in self.records.values() if r.finish_time is not None)
        tokens = sum(r.num_output for r in self.records.values())
        stats = self.engine.scheduler
        logger.info("t=%6.1fs sent %d/%d finished %d running %d waiting %d | %.0f out tok/s, %d steps (%.1f ms/step)",
                    now, len(self.records) - len(self.pending), len(self.records), done, len(stats.running),
                    len(stats.waiting), tokens / max(now, 1e-9), self.steps,
                    1000 * self.step_time / max(self.steps, 1))  # fmt: skip


def roofline_setup(engine: LLMEngine, peaks: roofline.Peaks) -> roofline.Setup:
    """The roofline of this engine's runs: its model, dtype, batch limits and adapters."""
    limits = roofline.Limits(engine.config.max_num_seqs, engine.config.max_batch_tokens)
    return roofline.Setup(engine.spec, engine.dtype.itemsize, limits, peaks, engine.store.path_of)


def run_one(
    engine: LLMEngine,
    spec: RunSpec,
    options: ReplayOptions,
    name: str,
    group: str = "engine",
    peaks: roofline.Peaks = roofline.H200_SPEC,
) -> dict[str, Any]:
    """Replay one run on `engine` (adapters preloaded, kernels warmed, the pool emptied before the clock); its
    results-file run, with its roofline (outside the clock)."""
    trace = spec.load()
    logger.info("run %s: %s (%d requests, mode %s)", name, spec.trace_path, len(trace), spec.mode)
    preload_s = preload_adapters(engine, trace.adapters(), options.preload_workers) if options.preload else 0.0
    engine.capture_graphs_for_host_adapters()  # as a server does after its preload (no-op without graphs)
    warm_up(engine, trace, options)
    engine.evict_adapters()
    before = engine.stats()
    compiled_before = variant_keys()
    tables = engine.runner.lora_tables
    tables_before = (tables.builds, tables.hits)
    replay = Replay(engine, trace, options, desc=name)
    # as a serving process once started: no full collection of the start's objects, few young collections
    with startup_objects_frozen(), young_threshold_raised():
        clock_start = engine.stats()  # after the freeze's own full collection, which is not the run's
        duration = replay.run()
    after = engine.stats()
    compiled_keys = keys_since(compiled_before)
    compiles = {kernel: len(keys) for kernel, keys in compiled_keys.items()}
    if compiles:
        logger.warning("%s: kernel variants compiled inside the clock (the warm-up missed them): %s", name,
                       compiled_keys)  # fmt: skip
    metrics = summarize(list(replay.records.values()), duration, options.window_fraction)
    metrics.update(
        engine_steps=replay.steps,
        cold_adapter_requests=replay.cold_requests,
        mean_step_ms=1000 * replay.step_time / max(replay.steps, 1),
        step_time_share=replay.step_time / duration if duration > 0 else None,
        overload_refusals=replay.refusals,
        adapter_loads=after.adapter_loads - before.adapter_loads,
        adapter_evictions=after.adapter_evictions - before.adapter_evictions,
        preemptions=after.preemptions - before.preemptions,
        preload_s=preload_s,
        step_kinds={kind: tally.summary() for kind, tally in sorted(replay.kinds.items())},
        gc=gc_between(clock_start, after),  # the process's garbage collections in the run (gc_pauses.py)
        # steps whose LoRA tables were built (their adapter list changed) and reused (lora_tables.py); a decode
        # step built from the one before (decode_batch.py) asks for none
        lora_tables={"built": tables.builds - tables_before[0], "reused": tables.hits - tables_before[1]},
        triton_compiles=sum(compiles.values()),  # kernel variants compiled inside the clock (warm-up missed)
        triton_compiles_by_kernel=compiles,
        triton_compile_keys=compiled_keys,  # their specialization keys: which launch shape the warm-up missed
        **roofline.roofline_metrics(trace, roofline_setup(engine, peaks), duration),
    )
    options_info = {**asdict(options), "mode": spec.mode, "engine": _engine_info(engine)}
    records = list(replay.records.values())
    return make_run(name, "engine", trace_info(trace, spec.trace_path), options_info, metrics,
                    group=group, per_request=per_request(records))  # fmt: skip


def _engine_info(engine: LLMEngine) -> dict[str, Any]:
    config = {k: v for k, v in asdict(engine.config).items()}
    return {"config": config, "ops": getattr(engine.model.ops, "name", "?"), "device": str(engine.device),
            "dtype": str(engine.dtype), "pool_pages": engine.pool.num_pages}  # fmt: skip


def engine_config(args: argparse.Namespace) -> EngineConfig:
    values: dict[str, Any] = {"model": str(args.model), "load_format": args.load_format, "device": args.device,
                              "dtype": args.dtype, "kernel_backend": args.kernel_backend}  # fmt: skip
    if args.adapter_root:
        values["adapter_root"] = str(args.adapter_root)
    if args.host_budget:
        values["host_budget_bytes"] = parse_size(args.host_budget)
    for item in args.engine_opt:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--engine-opt wants KEY=VALUE, got {item!r}")
        values[key] = value
    return EngineConfig.from_dict(values)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="TRACE[@MODE], MODE one of " + ", ".join(MODES))
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--adapter-root", type=Path)
    parser.add_argument("--load-format", default="dummy", choices=("dummy", "safetensors"))
    parser.add_argument("--kernel-backend", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--host-budget", help="host memory for adapters, e.g. 64GiB")
    parser.add_argument("--engine-opt", action="append", default=[], help="any EngineConfig field, KEY=VALUE")
    parser.add_argument("--name-prefix", default="engine", help="runs are named <prefix>-<trace>-<mode>")
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--warmup-requests", type=int, nargs="+", default=[8, 64, 256],
                        help="warm-up waves: requests per wave (0 for none)")  # fmt: skip
    parser.add_argument("--no-preload", action="store_true", help="load adapters on first use, inside the clock")
    parser.add_argument("--preload-workers", type=int, help="threads reading adapters (default: one per core, <= 8)")
    parser.add_argument("--profile", type=int, nargs="+", default=[], metavar="START... COUNT",
                        help="after the runs, profile COUNT steps from each step START of an unmeasured pass "
                             "(say 20 100 3: prefill-heavy mixed steps, then decode steps)")  # fmt: skip
    parser.add_argument("--profile-replay", type=int, nargs=2, metavar=("START", "COUNT"),
                        help="after the runs, replay the last adapter run and the last base run once more in real "
                             "time, profiling COUNT steps from step START of each (see top)")  # fmt: skip
    parser.add_argument("--profile-file", type=Path, help="append the profile tables here")
    parser.add_argument("--profile-trace-dir", type=Path,
                        help="keep --profile-replay's chrome traces here (trace-TRACE-MODE.json.gz)")  # fmt: skip
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (default: on a terminal)")
    roofline.add_peak_arguments(parser)
    parser.add_argument("--out", type=Path, required=True, help="results JSON (runs are added to it)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    specs = [RunSpec.parse(text) for text in args.runs]
    options = ReplayOptions(time_limit_s=args.time_limit, warmup_requests=tuple(args.warmup_requests),
                            preload=not args.no_preload, preload_workers=args.preload_workers,
                            progress_bar=not args.no_progress)  # fmt: skip
    peaks = roofline.peaks_from_args(args)
    started = time.perf_counter()
    engine = LLMEngine(engine_config(args))
    logger.info("engine ready in %.1fs (ops %s)", time.perf_counter() - started, getattr(engine.model.ops, "name", "?"))
    for spec in specs:
        name = f"{args.name_prefix}-{spec.trace_path.stem}-{spec.mode}"
        try:
            run = run_one(engine, spec, options, name, args.name_prefix, peaks)
        except (SloraError, OSError, ValueError) as exc:  # e.g. an adapter of the trace missing: next run
            logger.error("run %s failed: %s", name, exc)
            continue
        append_runs(args.out, [run])
        logger.info("%s", headline(run))
    if len(args.profile) >= 2 and args.profile[-1] > 0:  # the last adapter run, else the last base run
        profile_pass(engine, replayed_specs(specs)[0], args.profile[:-1], args.profile[-1], args.profile_file)
    if args.profile_replay:
        start, count = args.profile_replay
        for spec in replayed_specs(specs):
            trace = None
            if args.profile_trace_dir is not None:
                trace = args.profile_trace_dir / f"trace-{spec.trace_path.stem}-{spec.mode}.json.gz"
            profile_replay(engine, spec, options, start, count, args.profile_file, trace)


def replayed_specs(specs: list[RunSpec]) -> list[RunSpec]:
    """The last run that uses adapters and the last base-model run, in that order (those that exist)."""
    lora = [spec for spec in specs if spec.mode != "base"]
    base = [spec for spec in specs if spec.mode == "base"]
    return [group[-1] for group in (lora, base) if group]


def profile_replay(
    engine: LLMEngine,
    spec: RunSpec,
    options: ReplayOptions,
    start: int,
    count: int,
    out_file: Path | None,
    trace_file: Path | None = None,
) -> None:
    """Unmeasured: the trace replayed in real time as a measured run, adapters cold on the GPU, steps START..
    START + 2 COUNT profiled (StepProfiler)."""
    engine.evict_adapters()
    title = f"from step {start} of a real-time replay of {spec.trace_path.name}@{spec.mode} on {engine.model.ops.name}"
    profiler = StepProfiler(start, count, out_file, title, trace_file)
    logger.info("profiled replay: %s", title)
    Replay(engine, spec.load(), options, profiler).run()
    profiler.finish()


def profile_pass(engine: LLMEngine, spec: RunSpec, starts: list[int], count: int, out_file: Path | None) -> None:
    """Unmeasured: the trace's first 256 requests at once; from each start, profile `count` steps, then abort.

    Windows that would overlap the previous one are dropped (each takes 2 × count steps: see StepProfiler).
    """
    trace = spec.load()
    title = f"of {spec.trace_path.name}@{spec.mode} on {engine.model.ops.name}"
    windows: list[StepProfiler] = []
    for start in sorted(starts):
        if not windows or start >= windows[-1].total_steps:
            windows.append(StepProfiler(start, count, out_file, f"from step {start} {title}"))
    requests = trace.requests[:256]
    ids = [engine.add_request(list(r.prompt_ids), r.adapter, r.sampling(), detokenize=False) for r in requests]
    for _ in range(windows[-1].total_steps if windows else 0):
        if not engine.has_unfinished():
            break
        for profiler in windows:
            profiler.before_step()
        engine.step()
        for profiler in windows:
            profiler.after_step()
    for profiler in windows:
        profiler.finish()
    for rid in ids:
        engine.abort(rid)
    engine.evict_adapters()


if __name__ == "__main__":
    main()
