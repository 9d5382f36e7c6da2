"""The roofline of a replayed trace: the least time one GPU needs for the trace's bytes and FLOPs.

    python -m perf.roofline --model /tmp/slora-perf/model --adapter-root /tmp/slora-perf/adapters/S1 \\
        traces/s1-n2000.jsonl traces/s1-n2000.jsonl@base
    python -m perf.roofline --model /tmp/slora-perf/model --adapter-root /tmp/slora-perf/adapters/S1 \\
        --results results.json                      # add the roofline to each run of a results file that lacks it

bench_engine and bench_serving attach it to every run they write (`metrics.roofline`, `metrics.roofline_fraction`)
and perf/report.py tables it. The model is an ideal engine: the engine's own schedule, with no cost but the GPU's.

1. Steps. Requests join the queue at their arrival time and are admitted in arrival order at the start of a step,
   at most `max_num_seqs` running; the KV cache never runs out (no preemption). A step takes, in admission order,
   one token of each running request that decodes and the next chunk of each prompt, within `max_batch_tokens`
   tokens (the engine's scheduler: running requests first, then new ones). A prompt's last chunk also yields the
   first output token, each decode one more; a request is done with its `output_len`-th token. With nothing to
   run, the clock jumps to the next arrival. So a request spends at least `output_len` steps in the engine and a
   step holds at most `max_num_seqs` requests: the step count follows from the trace and the limits alone.
2. Bytes of a step, the HBM traffic no kernel avoids: the base weights once (every decoder layer's projections,
   norms and Qwen2's qkv bias, the final norm), the LM head once if a token of the step gets logits, one embedding
   row per token; the KV cache: each token writes its K and V, a decode at position p reads the p positions before
   it, a prompt chunk starting at position s reads the s positions before it once (its own stay on chip); each
   adapter used by a token of the step: all its A and B matrices once, in the engine's dtype (the LoRA runs' bytes
   floor). Activations are left out (a few MB a step).
3. FLOPs of a step: 2 x the layers' projection parameters per token; 2 x hidden x vocab per token that gets logits;
   attention 4 x heads x head_dim x layers per (query, key) pair, a token at position p attending to p + 1
   positions; an adapter 2 x its elements per token that uses it. Prompt tokens count like any other (prefill).
4. A step's time is max(bytes / bandwidth, FLOPs / peak): reads and math overlap perfectly, nothing else costs.
5. The trace's roofline time is the finish of its last request, from the start of the replay (S-LoRA's throughput
   counts the same span); a run's `fraction` is roofline time / measured duration (1.0: as fast as the GPU allows
   this schedule). `burst` is the same requests all arriving at 0: the throughput the GPU could sustain on this mix
   of requests, the ceiling of any saturating rate.

It is the floor of this schedule, not of every schedule: an engine that grouped requests by adapter or ran larger
batches could read fewer bytes. Peaks default to the datasheet of the GPU that runs (`--peaks auto`: the H100's or
the H200's; the H200's elsewhere); `--peaks h200-measured` (or --hbm-tb-s and --peak-tflops) gives what kernels
reach on an H200.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import struct
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from perf.results import gpu_name
from perf.workload import MODES, RunSpec, Trace, in_mode, load_trace
from slora.backend.model.spec import ModelSpec

logger = logging.getLogger(__name__)

# NVIDIA H200 SXM datasheet: 141 GB of HBM3e at 4.8 TB/s; bf16 tensor cores 1979 TFLOP/s with 2:4 sparsity, so
# 989 dense.
H200_HBM_BYTES_S = 4.8e12
H200_BF16_DENSE_FLOP_S = 989e12
# What kernels reach on an H200, measured by perf/bench_kernels.py (a 1 GB device-to-device copy and a large bf16
# matmul, perf/RESULTS.md): the floor a real kernel can get to.
H200_COPY_BYTES_S = 4.23e12
H200_GEMM_FLOP_S = 790e12
# NVIDIA H100 SXM datasheet: 80 GB of HBM3 at 3.35 TB/s; the H200's tensor cores, so the same 989 TFLOP/s dense.
H100_HBM_BYTES_S = 3.35e12
H100_BF16_DENSE_FLOP_S = H200_BF16_DENSE_FLOP_S

BYTE_KINDS = ("weights", "lm_head", "embeddings", "kv_read", "kv_write", "adapters")
FLOP_KINDS = ("projections", "lm_head", "attention", "lora")
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class Peaks:
    """A GPU's peak HBM bandwidth and dense matmul rate, and where the figures come from."""

    hbm_bytes_s: float
    flop_s: float
    source: str

    def __post_init__(self) -> None:
        for name in ("hbm_bytes_s", "flop_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


H200_SPEC = Peaks(H200_HBM_BYTES_S, H200_BF16_DENSE_FLOP_S, "H200 SXM datasheet (HBM3e 4.8 TB/s, bf16 989 TFLOP/s)")
H200_MEASURED = Peaks(H200_COPY_BYTES_S, H200_GEMM_FLOP_S, "H200, perf/bench_kernels.py (copy 4.23 TB/s, 790 TFLOP/s)")
H100_SPEC = Peaks(H100_HBM_BYTES_S, H100_BF16_DENSE_FLOP_S, "H100 SXM datasheet (HBM3 3.35 TB/s, bf16 989 TFLOP/s)")
PEAKS = {"h200": H200_SPEC, "h200-measured": H200_MEASURED, "h100": H100_SPEC}


def peaks_of_gpu(name: str | None) -> Peaks:
    """The datasheet peaks of the GPU that torch names: a fraction of the roofline must be of the GPU that ran.
    PCIe and NVL parts have other clocks and bandwidths, so only the SXM names match; any other GPU (or none) gets
    the H200's peaks with a warning, and --peaks or --hbm-tb-s / --peak-tflops say its own."""
    text = (name or "").upper()
    if not any(part in text for part in ("PCIE", "NVL")):
        if "H200" in text:
            return H200_SPEC
        if "H100" in text:
            return H100_SPEC
    logger.warning("no datasheet peaks for GPU %r: the roofline uses the H200's (--peaks to choose)", name)
    return H200_SPEC


@dataclass(frozen=True)
class Limits:
    """The engine's batch limits (EngineConfig.max_num_seqs and max_batch_tokens)."""

    max_num_seqs: int
    max_batch_tokens: int

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")

    @classmethod
    def engine_defaults(cls) -> Limits:
        """The limits of an engine given none: "auto", which a CPU engine resolves to these (a CUDA engine sizes
        them from its pool at start and logs them: pass those to compare with a served GPU run)."""
        from slora.backend.engine.defaults import CPU_MAX_BATCH_TOKENS, CPU_MAX_NUM_SEQS

        return cls(CPU_MAX_NUM_SEQS, CPU_MAX_BATCH_TOKENS)


@dataclass(frozen=True)
class ModelCost:
    """What the base model costs a step, in bytes and FLOPs (module docstring, points 2 and 3)."""

    weight_bytes: int  # decoder layers and final norm, read once per step
    lm_head_bytes: int  # read once per step with logits
    embed_row_bytes: int  # per token
    kv_bytes_per_token: int  # K and V of one position, every layer
    projection_flops_per_token: int
    lm_head_flops_per_token: int
    attention_flops_per_pair: int  # one (query, key) pair, every layer

    @classmethod
    def from_spec(cls, spec: ModelSpec, dtype_bytes: int) -> ModelCost:
        h, q, kv, i = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
        projections = h * (q + 2 * kv) + q * h + 3 * h * i  # qkv, o, gate + up, down
        bias = q + 2 * kv if spec.qkv_bias else 0
        layer = projections + bias + 2 * h  # and the two norms
        return cls(
            weight_bytes=(spec.num_layers * layer + h) * dtype_bytes,
            lm_head_bytes=spec.vocab_size * h * dtype_bytes,
            embed_row_bytes=h * dtype_bytes,
            kv_bytes_per_token=2 * spec.num_layers * kv * dtype_bytes,
            projection_flops_per_token=2 * spec.num_layers * projections,
            lm_head_flops_per_token=2 * h * spec.vocab_size,
            attention_flops_per_pair=4 * spec.num_layers * q,
        )


@dataclass(frozen=True)
class AdapterCost:
    """One adapter's A and B matrices, every layer and target: read once per step that uses it."""

    bytes: int
    flops_per_token: int

    @classmethod
    def from_elements(cls, elements: int, dtype_bytes: int) -> AdapterCost:
        return cls(elements * dtype_bytes, 2 * elements)


@dataclass(frozen=True)
class Work:
    """What the roofline needs of one request."""

    arrival: float
    input_len: int
    output_len: int
    adapter: str | None


def works_of(trace: Trace, burst: bool = False) -> list[Work]:
    """The trace's requests (all arriving at 0 with `burst`)."""
    return [Work(0.0 if burst else r.arrival, r.input_len, r.output_len, r.adapter) for r in trace.requests]


class _Running:
    """The running requests, in admission order, as arrays (a step's work is a few array operations, not a loop
    over requests: a 120 s trace has tens of thousands of steps)."""

    def __init__(self) -> None:
        empty = np.empty(0, dtype=np.int64)
        self.input, self.output, self.adapter, self.prefilled, self.emitted = (empty.copy() for _ in range(5))

    def __len__(self) -> int:
        return len(self.input)

    def admit(self, works: list[Work], index: dict[str | None, int]) -> None:
        """Append `works` (adapter names as indices into the cost arrays; -1: the base model)."""
        grow = {"input": [w.input_len for w in works], "output": [w.output_len for w in works],
                "adapter": [index[w.adapter] for w in works], "prefilled": [0] * len(works),
                "emitted": [0] * len(works)}  # fmt: skip
        for name, values in grow.items():
            setattr(self, name, np.concatenate([getattr(self, name), np.asarray(values, dtype=np.int64)]))

    def plan(self, budget: int) -> np.ndarray:
        """Tokens of each request in the next step: a decode takes 1, a prompt its next chunk, in admission order
        until the token budget is spent."""
        need = np.where(self.prefilled == self.input, 1, self.input - self.prefilled)
        before = np.cumsum(need) - need
        return np.clip(budget - before, 0, need)

    def cost(self, take: np.ndarray, model: ModelCost, adapters: _AdapterArrays) -> tuple[list[int], list[int]]:
        """(bytes by BYTE_KINDS, FLOPs by FLOP_KINDS) of the step that processes `take` tokens of each request."""
        decoding = self.prefilled == self.input
        start = np.where(decoding, self.input + self.emitted - 1, self.prefilled)  # position of the first token
        active = take > 0
        tokens = int(take.sum())
        logits = int((active & (decoding | (self.prefilled + take == self.input))).sum())
        kv_read = int(start[active].sum())  # the positions before each token (decode) or chunk (prompt)
        pairs = int((take * start + take * (take + 1) // 2).sum())  # a token at position p attends to p + 1
        used = self.adapter[active & (self.adapter >= 0)]
        lora_tokens = take[active & (self.adapter >= 0)]
        distinct = np.unique(used)
        nbytes = [model.weight_bytes, model.lm_head_bytes if logits else 0, tokens * model.embed_row_bytes,
                  kv_read * model.kv_bytes_per_token, tokens * model.kv_bytes_per_token,
                  int(adapters.bytes[distinct].sum())]  # fmt: skip
        flops = [tokens * model.projection_flops_per_token, logits * model.lm_head_flops_per_token,
                 pairs * model.attention_flops_per_pair, int((adapters.flops[used] * lora_tokens).sum())]  # fmt: skip
        return nbytes, flops

    def advance(self, take: np.ndarray) -> tuple[int, int]:
        """Process the step: prompts move on (the last chunk yields a token), decodes yield one; the finished leave.
        Returns (requests finished, their output tokens)."""
        decoding = self.prefilled == self.input
        self.prefilled = self.prefilled + np.where(decoding, 0, take)
        self.emitted = self.emitted + ((decoding & (take > 0)) | (~decoding & (self.prefilled == self.input)))
        done = self.emitted >= self.output
        finished, tokens = int(done.sum()), int(self.emitted[done].sum())
        if finished:
            keep = ~done
            for name in ("input", "output", "adapter", "prefilled", "emitted"):
                setattr(self, name, getattr(self, name)[keep])
        return finished, tokens


@dataclass(frozen=True)
class _AdapterArrays:
    """Adapter costs by index (the order of `names`)."""

    names: tuple[str, ...]
    bytes: np.ndarray
    flops: np.ndarray

    @classmethod
    def of(cls, adapters: dict[str, AdapterCost]) -> _AdapterArrays:
        names = tuple(sorted(adapters))
        return cls(names, np.asarray([adapters[n].bytes for n in names], dtype=np.int64),
                   np.asarray([adapters[n].flops_per_token for n in names], dtype=np.int64))  # fmt: skip

    def index(self) -> dict[str | None, int]:
        return {None: -1, **{name: i for i, name in enumerate(self.names)}}


@dataclass(frozen=True)
class Roofline:
    """The ideal engine's replay of a list of requests (module docstring)."""

    seconds: float  # finish of the last request
    busy_s: float  # time in steps (the rest: waiting for arrivals)
    steps: int
    memory_bound_steps: int
    num_requests: int
    output_tokens: int
    bytes: dict[str, float]
    flops: dict[str, float]

    @property
    def rps(self) -> float:
        return self.num_requests / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        tok_s = self.output_tokens / self.seconds if self.seconds > 0 else 0.0
        return {**asdict(self), "rps": self.rps, "output_tok_s": tok_s}


def simulate(
    works: Iterable[Work], model: ModelCost, adapters: dict[str, AdapterCost], limits: Limits, peaks: Peaks
) -> Roofline:
    """Replay `works` on the ideal engine; `adapters` must hold every adapter named."""
    pending = deque(sorted(works, key=lambda w: w.arrival))
    table = _AdapterArrays.of(adapters)
    index = table.index()
    waiting: deque[Work] = deque()
    running = _Running()
    nbytes, flops = [0] * len(BYTE_KINDS), [0] * len(FLOP_KINDS)
    clock = busy = 0.0
    steps = memory_bound = requests = output_tokens = 0
    while pending or waiting or len(running):
        while pending and pending[0].arrival <= clock:
            waiting.append(pending.popleft())
        if not len(running) and not waiting:
            clock = pending[0].arrival
            continue
        seats = min(limits.max_num_seqs - len(running), len(waiting))
        if seats > 0:
            running.admit([waiting.popleft() for _ in range(seats)], index)
        take = running.plan(limits.max_batch_tokens)
        step_bytes, step_flops = running.cost(take, model, table)
        read_s, math_s = sum(step_bytes) / peaks.hbm_bytes_s, sum(step_flops) / peaks.flop_s
        clock, busy, steps = clock + max(read_s, math_s), busy + max(read_s, math_s), steps + 1
        memory_bound += read_s >= math_s
        nbytes = [total + value for total, value in zip(nbytes, step_bytes, strict=True)]
        flops = [total + value for total, value in zip(flops, step_flops, strict=True)]
        finished, tokens = running.advance(take)
        requests, output_tokens = requests + finished, output_tokens + tokens
    return Roofline(clock, busy, steps, memory_bound, requests, output_tokens, dict(zip(BYTE_KINDS, nbytes)),
                    dict(zip(FLOP_KINDS, flops)))  # fmt: skip


# ---- adapters: their elements, from their files or from their perf/make_adapters.py setting -----------------------


def safetensors_elements(path: Path) -> int:
    """Elements of the LoRA A and B tensors in a safetensors file, from its header alone (no tensor is read)."""
    stat = path.stat()
    return _header_elements(str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=256)  # adapters of make_adapters share a few hard-linked files
def _header_elements(path: str, inode: int, size: int, mtime_ns: int) -> int:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(math.prod(entry["shape"]) for name, entry in header.items() if ".lora_A." in name or ".lora_B." in name)


def setting_elements(name: str, spec: ModelSpec) -> int | None:
    """Elements of an adapter of perf/make_adapters.py's settings, from its name (<prefix><index>); None if its name
    is not one of theirs."""
    from perf.make_adapters import SETTINGS

    for setting in SETTINGS.values():
        index = name.removeprefix(setting.prefix)
        if index != name and index.isdigit():
            rank = setting.rank_of(int(index))
            per_layer = sum(rank * sum(spec.module_shape(module)) for module in setting.targets)
            return spec.num_layers * per_layer
    return None


Locate = Callable[[str], "Path | None"]


@dataclass(frozen=True)
class Setup:
    """Everything the roofline of a trace needs besides the trace: the model, its dtype, the engine's limits, the
    GPU's peaks, and where adapters are (a name -> folder function, None where unknown)."""

    spec: ModelSpec
    dtype_bytes: int
    limits: Limits
    peaks: Peaks
    locate: Locate = field(default=lambda name: None, compare=False)

    def model_cost(self) -> ModelCost:
        return ModelCost.from_spec(self.spec, self.dtype_bytes)

    def adapter_costs(self, names: Iterable[str]) -> dict[str, AdapterCost]:
        """Each adapter's cost, from its weights file (exact: any rank pattern), else from its setting's name;
        ValueError naming an adapter neither gives."""
        costs = {}
        for name in set(names):
            folder = self.locate(name)
            weights = folder / WEIGHTS_FILE if folder is not None else None
            if weights is not None and weights.is_file():
                elements: int | None = safetensors_elements(weights)
            else:
                elements = setting_elements(name, self.spec)
            if elements is None:
                raise ValueError(f"adapter {name!r}: no {WEIGHTS_FILE} found and not a perf/make_adapters.py name")
            costs[name] = AdapterCost.from_elements(elements, self.dtype_bytes)
        return costs


def setup_for_model_dir(
    model: Path,
    adapter_root: Path | None,
    limits: Limits,
    peaks: Peaks,
    dtype_bytes: int = 2,
) -> Setup:
    """A Setup from a model folder (config.json) and the folder holding one folder per adapter."""

    def locate(name: str) -> Path | None:
        return adapter_root / name if adapter_root is not None else None

    return Setup(ModelSpec.from_dir(model), dtype_bytes, limits, peaks, locate)


def roofline(trace: Trace, setup: Setup) -> dict[str, Any]:
    """The trace's roofline and its burst variant, JSON-ready (what a results file's run holds in
    metrics.roofline)."""
    model = setup.model_cost()
    adapters = setup.adapter_costs(name for name in (r.adapter for r in trace.requests) if name is not None)
    timed = simulate(works_of(trace), model, adapters, setup.limits, setup.peaks)
    burst = simulate(works_of(trace, burst=True), model, adapters, setup.limits, setup.peaks)
    return {
        **timed.to_dict(),
        "burst": {key: burst.to_dict()[key] for key in ("seconds", "rps", "busy_s", "steps")},
        "peaks": asdict(setup.peaks),
        "limits": asdict(setup.limits),
        "model": asdict(model),
        "dtype_bytes": setup.dtype_bytes,
    }


def fraction(roof: dict[str, Any] | None, duration_s: float | None) -> float | None:
    """Roofline time / measured duration: the share of the GPU's best this run reached."""
    if not roof or not duration_s or duration_s <= 0:
        return None
    return float(roof["seconds"]) / duration_s


def roofline_metrics(trace: Trace, setup: Setup | None, duration_s: float) -> dict[str, Any]:
    """`roofline` and `roofline_fraction` for a run's metrics; both None without a Setup (or if it fails)."""
    if setup is None:
        return {"roofline": None, "roofline_fraction": None}
    try:
        roof = roofline(trace, setup)
    except (ValueError, OSError) as exc:  # e.g. an adapter the roofline cannot size: the run itself stands
        logger.warning("no roofline for this run: %s", exc)
        return {"roofline": None, "roofline_fraction": None}
    logger.info("%s", describe(roof, duration_s))
    return {"roofline": roof, "roofline_fraction": fraction(roof, duration_s)}


def describe(roof: dict[str, Any], duration_s: float | None = None) -> str:
    """One log line."""
    gb = {kind: value / 1e9 for kind, value in roof["bytes"].items()}
    measured = f", measured {duration_s:.1f} s: {fraction(roof, duration_s):.3f} of it" if duration_s else ""
    burst = roof["burst"]["rps"]
    return (
        f"roofline {roof['seconds']:.2f} s ({roof['rps']:.2f} req/s, burst {burst:.2f} req/s){measured}; "
        f"{roof['steps']} steps, {roof['memory_bound_steps'] / max(roof['steps'], 1):.0%} bound by bytes, "
        f"busy {roof['busy_s']:.2f} s; GB read: weights {gb['weights'] + gb['lm_head']:.0f}, "
        f"KV {gb['kv_read']:.0f}, adapters {gb['adapters']:.1f}; TFLOP {sum(roof['flops'].values()) / 1e12:.0f}"
    )


# ---- command line ------------------------------------------------------------------------------------------------


def add_peak_arguments(parser: argparse._ActionsContainer) -> None:
    """--peaks, --hbm-tb-s, --peak-tflops on a parser or an argument group."""
    parser.add_argument("--peaks", choices=("auto", *sorted(PEAKS)), default="auto",
                        help="the GPU's peaks (roofline); auto: the datasheet of the GPU here")  # fmt: skip
    parser.add_argument("--hbm-tb-s", type=float, help="override the peak bandwidth, TB/s (e.g. a measured copy)")
    parser.add_argument("--peak-tflops", type=float, help="override the peak bf16 matmul rate, TFLOP/s")


def peaks_from_args(args: argparse.Namespace) -> Peaks:
    peaks = peaks_of_gpu(gpu_name()) if args.peaks == "auto" else PEAKS[args.peaks]
    if args.hbm_tb_s is not None or args.peak_tflops is not None:
        bandwidth = args.hbm_tb_s * 1e12 if args.hbm_tb_s is not None else peaks.hbm_bytes_s
        flops = args.peak_tflops * 1e12 if args.peak_tflops is not None else peaks.flop_s
        source = f"{peaks.source}, overridden: {bandwidth / 1e12:g} TB/s, {flops / 1e12:g} TFLOP/s"
        peaks = Peaks(bandwidth, flops, source)
    return peaks


def annotate_results(path: Path, setup: Setup, force: bool = False, device_peaks: bool = False) -> int:
    """Add the roofline to each run of a results file that lacks one (each run's own engine limits where it recorded
    them, and with `device_peaks` the datasheet peaks of the GPU it recorded, not of this machine's); returns how
    many runs got one."""
    data = json.loads(path.read_text())
    added = 0
    for run in data["runs"]:
        metrics, trace_path = run["metrics"], run["trace"].get("path")
        if run.get("kind") == "peft" or (metrics.get("roofline") and not force) or not trace_path:
            continue
        mode = run["options"].get("mode", "lora")
        trace = in_mode(load_trace(Path(trace_path)), mode if mode in MODES else "lora")
        run_setup = replace(setup, limits=_run_limits(run, setup.limits))
        if device_peaks:
            run_setup = replace(run_setup, peaks=peaks_of_gpu(run.get("env", {}).get("device")))
        metrics.update(roofline_metrics(trace, run_setup, metrics["duration_s"]))
        added += metrics["roofline"] is not None
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)
    return added


def _run_limits(run: dict[str, Any], default: Limits) -> Limits:
    config = run["options"].get("engine", {}).get("config", {})
    if "max_num_seqs" in config and "max_batch_tokens" in config:
        return Limits(int(config["max_num_seqs"]), int(config["max_batch_tokens"]))
    return default


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", help="TRACE[@MODE], MODE one of " + ", ".join(MODES))
    parser.add_argument("--model", type=Path, required=True, help="model folder (config.json)")
    parser.add_argument("--adapter-root", type=Path, help="adapter folders (default: sized from make_adapters' names)")
    defaults = Limits.engine_defaults()
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-batch-tokens", type=int, default=defaults.max_batch_tokens)
    parser.add_argument("--dtype-bytes", type=int, default=2, help="bytes per weight element (2: bf16/fp16)")
    parser.add_argument("--results", type=Path, help="add the roofline to the runs of this results file")
    parser.add_argument("--force", action="store_true", help="with --results: replace rooflines already there")
    add_peak_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    setup = setup_for_model_dir(args.model, args.adapter_root, Limits(args.max_num_seqs, args.max_batch_tokens),
                                peaks_from_args(args), args.dtype_bytes)  # fmt: skip
    for text in args.runs:
        spec = RunSpec.parse(text)
        logger.info("%s@%s: %s", spec.trace_path.name, spec.mode, describe(roofline(spec.load(), setup)))
    if args.results:
        by_device = args.peaks == "auto" and args.hbm_tb_s is None and args.peak_tflops is None
        added = annotate_results(args.results, setup, args.force, by_device)
        logger.info("%s: roofline added to %d run(s)", args.results, added)
    if not args.runs and not args.results:
        parser.error("give traces, --results, or both")


if __name__ == "__main__":
    main()
