"""Kernel benchmark on one GPU: each Triton kernel against the least it must move and compute, and two baselines.

    python perf/bench_kernels.py --out results/kernels.json

For every kernel and shape it measures the GPU time (a CUDA graph of the call replayed with L2 flushed before
each call, so without Python and launch overhead; --flush read, the default since session 5, leaves the L2 clean,
--flush write dirty as before: see flush_mode; "eager ms" is triton.testing.do_bench's time with them) and
reports achieved bandwidth and FLOP/s on the op's *minimum* bytes and FLOPs (each adapter's rows, x and the
touched columns of y read once; each K/V row read once), and what fraction that is of this GPU's copy bandwidth
and bf16 matmul rate, both measured in the same process; "%sscp" compares each Triton kernel with a plain copy
moving its minimum bytes, timed the same way: at a few MB a copy too stays far below the bandwidth of a 1 GB copy,
so this shows how much of a shortfall is the op's own. Baselines in the same process: the plain-torch reference
(kernels/*_ref.py) and, for LoRA, S-LoRA's padded-bmm ("bmm", kernels/reference/lora_padded.py).

Shapes: Llama-2-7B (hidden 4096, intermediate 11008, 32 heads of 128, MHA) and a GQA model of the same width
(8 kv heads, intermediate 14336). Targets (issue 4): decode LoRA and decode attention >= 60% of copy bandwidth on
their minimum bytes, and so the attention of a step whose decodes sit beside prompts; mixed-rank LoRA >= 3x the
padded baseline. Results go to --out as JSON and to stdout as a table. Needs CUDA; takes about two minutes on
an H200 (--tune: config sweeps, about three more).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import logging
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import triton

from slora.backend.adapters.host_adapter import HostAdapter
from slora.backend.config import EngineConfig
from slora.backend.engine.defaults import AUTO_SEQS
from slora.backend.engine.request import Request
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.executor.batch import ScheduledSeq, build_batch, build_lora_meta, order_by_adapter
from slora.backend.executor.cuda_graphs import bucket_for, bucket_sizes
from slora.backend.executor.graph_families import rank_bound
from slora.backend.executor.mixed_graphs import seq_buckets
from slora.backend.executor.static_lora import StaticLora, decode_tiling, mixed_tiling
from slora.backend.memory.adapter_cache import AdapterCache, ResidentAdapter
from slora.backend.memory.page_pool import PageKind, PagePool, PoolGeometry
from slora.backend.model.spec import LORA_MODULES
from slora.kernels.metadata import AttentionMeta, LoraMeta
from slora.kernels.reference.attention import paged_attention_ref, write_kv_ref
from slora.kernels.reference.lora import lora_ref
from slora.kernels.reference.lora_padded import lora_padded_bmm
from slora.kernels.settings import KernelSettings
from slora.kernels.triton import lora_call, lora_expand, lora_fused, lora_shrink, paged_attention, paged_decode, pdl
from slora.kernels.triton.lora_expand import ExpandConfig
from slora.kernels.triton.lora_fused import FusedConfig, fused_lora
from slora.kernels.triton.lora_shrink import ShrinkConfig
from slora.kernels.triton.ops import TritonOps
from slora.kernels.triton.paged_attention import AttentionConfig
from slora.kernels.triton.paged_decode import DecodeConfig

logger = logging.getLogger("bench_kernels")
DEVICE = torch.device("cuda")  # --smoke on a machine without CUDA switches to the CPU (Triton's interpreter)

DECODE_BW_TARGET = 0.60  # fraction of copy bandwidth, decode LoRA and decode attention
# A step with prompts whose decodes dominate its attention bytes: the general kernel serves those decodes, so they
# too must read each K/V row once (the decode target).
DECODES_WITH_PROMPTS = "decodes with prompts"
PADDED_SPEEDUP_TARGET = 3.0  # mixed-rank LoRA vs the padded-bmm baseline
REF_TIME_LIMIT_MS = 2000.0  # a baseline slower than this per call is timed once instead of repeatedly


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int = 128

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    def widths(self, module: int) -> tuple[int, int]:
        """(in_features, out_features) of module index m of LORA_MODULES."""
        h, i, q, kv = self.hidden, self.intermediate, self.q_size, self.kv_size
        return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)][module]


LLAMA_7B = Model("llama2-7b", 4096, 11008, 32, 32)
GQA_8B = Model("gqa-8kv", 4096, 14336, 32, 8)


@dataclass
class Row:
    """One measurement."""

    kernel: str
    case: str
    impl: str
    ms: float
    min_bytes: int
    min_flops: int
    gbps: float = 0.0
    tflops: float = 0.0
    frac_copy: float = 0.0
    frac_matmul: float = 0.0
    max_rel_err: float | None = None
    eager_ms: float = 0.0  # with Python and launch overhead (do_bench); ms is GPU time when timing == "graph"
    timing: str = "eager"
    same_size_copy_ms: float | None = None  # a plain copy moving min_bytes, timed the same way (Triton rows)

    @property
    def frac_same_size_copy(self) -> float | None:
        """How close the op comes to a copy of its own size: at a few MB, fixed per-launch costs weigh in too."""
        return None if self.same_size_copy_ms is None else self.same_size_copy_ms / self.ms


@dataclass
class Device:
    name: str
    copy_gbps: float
    matmul_tflops: float


def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds of fn, L2 flushed before each run; slow baselines are timed once."""
    if DEVICE.type != "cuda":  # smoke run: one call
        start_s = time.perf_counter()
        fn()
        return (time.perf_counter() - start_s) * 1e3
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    once = start.elapsed_time(end)
    if once > REF_TIME_LIMIT_MS:
        return once
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


_flush: list[torch.Tensor] = []  # a buffer larger than L2, read (or written) before each timed call
# "read": the flush reads the buffer, so the op starts with an L2 full of clean lines of no use to it (as after the
# GEMMs that read the weights in a real step); "write" zeroes it, which leaves the L2 dirty: the op then also pays
# for writing those lines back to HBM as its reads evict them (up to the L2's size), which weighs on ops of a few MB.
FLUSH_MODES = ("read", "write")
flush_mode = "read"


def _flush_l2(buffer: torch.Tensor) -> None:
    if flush_mode == "write":
        buffer.zero_()
    else:
        buffer.sum(dtype=torch.int32)


def graph_bench(fn: Callable[[], object], reps: int = 20) -> float | None:
    """GPU milliseconds of fn with L2 flushed before each call, without launch overhead (CUDA graph replay).

    The graph holds `reps` times (flush, fn); a second graph holds the flushes alone, whose time is subtracted
    (flush_mode: how the L2 is flushed).
    None when fn cannot be captured (e.g. it copies host data to the device).
    """
    if not _flush:
        _flush.append(torch.empty(128 << 20, dtype=torch.uint8, device=DEVICE))  # > 2x the L2 of an H100/H200
    flush = _flush[0]
    try:
        fn()  # compiles kernels and builds per-step metadata outside the capture
        torch.cuda.synchronize()
        with_fn, flush_only = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(with_fn):
            for _ in range(reps):
                _flush_l2(flush)
                fn()
        with torch.cuda.graph(flush_only):
            for _ in range(reps):
                _flush_l2(flush)
    except RuntimeError as exc:
        logger.info("not capturable, timed eagerly: %s", str(exc).splitlines()[0][:120])
        torch.cuda.synchronize()
        return None
    samples = sorted((_replay_ms(with_fn) - _replay_ms(flush_only)) / reps for _ in range(7))
    return max(samples[len(samples) // 2], 1e-6)


def _replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end))


def timed(fn: Callable[[], object], capturable: bool = True) -> tuple[float, float, str]:
    """(ms, eager ms, how ms was taken): GPU time from graph replay where fn can be captured, else eager time."""
    eager = bench(fn)
    if DEVICE.type != "cuda" or not capturable or eager > REF_TIME_LIMIT_MS:
        return eager, eager, "eager"
    graph = graph_bench(fn)
    return (graph, eager, "graph") if graph is not None else (eager, eager, "eager")


def measure_device(smoke: bool = False) -> Device:
    """Copy bandwidth (bytes read + written per second) and dense bf16 matmul rate of this GPU; smoke: tiny sizes
    (a CPU run checks the code, not the figures)."""
    copy_bytes, n = (1 << 20, 64) if smoke else (1 << 30, 8192)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src))
    a = torch.randn((n, n), device=DEVICE).to(torch.bfloat16)
    b = torch.randn((n, n), device=DEVICE).to(torch.bfloat16)
    mm_ms = bench(lambda: a @ b)
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (smoke run)"
    return Device(name, 2 * copy_bytes / copy_ms / 1e6, 2 * n**3 / mm_ms / 1e9)


_copy_ms: dict[int, float] = {}


def same_size_copy_ms(min_bytes: int) -> float:
    """GPU time of copying min_bytes / 2 bytes (reading and writing min_bytes in all), as the ops are timed."""
    half = max(min_bytes // 2, 1)
    if half not in _copy_ms:
        src = torch.empty(half, dtype=torch.uint8, device=DEVICE)
        dst = torch.empty_like(src)
        _copy_ms[half] = timed(lambda: dst.copy_(src))[0]
    return _copy_ms[half]


def finish(row: Row, device: Device) -> Row:
    seconds = row.ms / 1e3
    row.gbps = row.min_bytes / seconds / 1e9
    row.tflops = row.min_flops / seconds / 1e12
    row.frac_copy = row.gbps / device.copy_gbps
    row.frac_matmul = row.tflops / device.matmul_tflops
    return row


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest difference relative to the largest value of the reference result."""
    scale = expected.float().abs().max().clamp_min(1e-6)
    return float((actual.float() - expected.float()).abs().max() / scale)


# ---------------------------------------------------------------- pools and metadata, as the engine builds them


def scrambled_pool(geometry: PoolGeometry, num_pages: int, dtype: torch.dtype) -> PagePool:
    pool = PagePool(geometry, num_pages, dtype, DEVICE)
    pages = pool.alloc(num_pages, PageKind.KV, "scramble")
    assert pages is not None
    random.Random(0).shuffle(pages)
    pool.free(pages, "scramble")
    pool.storage.normal_(0.0, 0.5)
    return pool


def host_adapter(
    name: str, model: Model, ranks: tuple[int, ...], geometry: PoolGeometry, dtype: torch.dtype
) -> HostAdapter:
    """Random adapter as a page image: rows packed in order, a row never straddling a page."""
    cursor = 0
    a_local: list[int] = []
    b_local: list[int] = []
    for m, rank in enumerate(ranks):
        for width, out in ((model.widths(m)[0], a_local), (model.widths(m)[1], b_local)):
            for _ in range(rank):
                if cursor % geometry.page_elems + width > geometry.page_elems:
                    cursor = -(-cursor // geometry.page_elems) * geometry.page_elems
                out.append(cursor)
                cursor += width
    pages = -(-cursor // geometry.page_elems)
    image = (torch.randn((1, pages, geometry.page_elems), device=DEVICE) * 0.05).to(dtype)
    return HostAdapter(
        name=name,
        path=Path(name),
        ranks=ranks,
        scales=tuple(1.0 if r else 0.0 for r in ranks),
        image=image,
        a_local=torch.tensor(a_local, dtype=torch.int64),
        b_local=torch.tensor(b_local, dtype=torch.int64),
    )


def request(
    i: int, length: int, computed: int, resident: ResidentAdapter | None = None, pages: list[int] | None = None
) -> Request:
    sampling = SamplingParams()
    return Request(str(i), [1] * length, length, sampling, num_computed=computed, pages=pages or [], resident=resident)


@dataclass
class LoraCase:
    name: str
    model: Model
    flat_layer: torch.Tensor
    meta: LoraMeta
    num_tokens: int
    decode_only: bool  # one token per sequence: a step the engine replays as a CUDA graph
    num_seqs: int  # sequences of the step


# --spread-pages: the LoRA cases' one-layer pool gets at least this many pages, the adapters' pages scattered over
# all of them, as in an engine whose layer band spans GBs (S2 runs on the H200: 13769 pages of 256 KiB, 3.4 GiB).
# 0: just the pages the case needs, a few hundred MB at most.
spread_pages = 0

kernel_settings = KernelSettings()  # main() sets it from --engine-option (EngineConfig's kernel fields)


def lora_case(
    name: str, model: Model, ranks: list[tuple[int, ...]], step: Sequence[tuple[int | None, int]]
) -> LoraCase:
    dtype = torch.bfloat16
    geometry = PoolGeometry(1, 16, model.kv_heads, model.head_dim)
    hosts = [host_adapter(f"a{i}", model, r, geometry, dtype) for i, r in enumerate(ranks)]
    pool = scrambled_pool(geometry, max(sum(h.num_pages for h in hosts) + 8, spread_pages), dtype)
    if spread_pages:
        name = f"{name} [pool of {pool.num_pages} pages]"
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()  # adapter copies run on a side stream: images and pool must be written first
    cache = AdapterCache(pool)
    residents = [cache.load(h) for h in hosts]
    for resident in residents:
        if resident is not None:
            resident.wait_copied(pool.storage.device)  # the copies run on the copier's thread (and a side stream)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    seqs = [ScheduledSeq(request(i, n, 0, None if a is None else residents[a]), n) for i, (a, n) in enumerate(step)]
    seqs = order_by_adapter(seqs)
    q_start = list(itertools.accumulate([s.num_tokens for s in seqs], initial=0))
    meta = build_lora_meta(seqs, q_start, DEVICE)
    assert meta is not None
    return LoraCase(name, model, pool.flat_layer(0), meta, q_start[-1], all(n == 1 for _, n in step), len(step))


def lora_calls(model: Model) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, modules, in_features) of a decoder layer's four LoRA calls (model.py)."""
    return [("qkv", (0, 1, 2), model.hidden), ("o", (3,), model.q_size), ("gate_up", (4, 5), model.hidden),
            ("down", (6,), model.intermediate)]  # fmt: skip


def call_outputs(model: Model, modules: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(first column, width) in y of each module of a LoRA call, side by side."""
    widths = tuple(model.widths(m)[1] for m in modules)
    return tuple(itertools.accumulate(widths, initial=0))[:-1], widths


def lora_minimum(case: LoraCase, modules: tuple[int, ...], in_features: int) -> tuple[int, int]:
    """Bytes and FLOPs one call must spend: each adapter's rows, its tokens' x and touched y, once."""
    (shrink_bytes, shrink_flops), (expand_bytes, expand_flops) = lora_part_minimums(case, modules, in_features)
    return shrink_bytes + expand_bytes, shrink_flops + expand_flops


def lora_part_minimums(
    case: LoraCase, modules: tuple[int, ...], in_features: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """(bytes, FLOPs) of the shrink (x and the A rows, once) and of the expand (the B rows, y read and written)."""
    meta, es = case.meta, 2
    shrink, expand = [0, 0], [0, 0]
    for g, a in enumerate(meta.seg_adapter_host):
        tokens = meta.seg_start_host[g + 1] - meta.seg_start_host[g]
        targeted = [m for m in modules if meta.ranks_host[a][m]]
        if targeted:
            shrink[0] += tokens * in_features * es
        for m in targeted:
            rank, out = meta.ranks_host[a][m], case.model.widths(m)[1]
            shrink[0] += rank * in_features * es
            shrink[1] += 2 * tokens * rank * in_features
            expand[0] += rank * out * es + 2 * tokens * out * es
            expand[1] += 2 * tokens * rank * out
    return (shrink[0], shrink[1]), (expand[0], expand[1])


def bench_lora(case: LoraCase, device: Device) -> list[Row]:
    """Each of the layer's four calls, then their sum as one row per implementation ("lora_layer")."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows: list[Row] = []
    for call, modules, in_features in lora_calls(case.model):
        rows += bench_lora_call(case, device, call, modules, in_features, gen)
    for impl in dict.fromkeys(r.impl for r in rows):  # each implementation (or part of one) timed, in order
        calls = [r for r in rows if r.impl == impl]
        how = "graph" if all(r.timing == "graph" for r in calls) else "mixed"
        eager = sum(r.eager_ms for r in calls)
        row = Row(
            "lora_layer",
            case.name,
            impl,
            sum(r.ms for r in calls),
            sum(r.min_bytes for r in calls),
            sum(r.min_flops for r in calls),
            eager_ms=eager,
            timing=how,
        )
        rows.append(finish(row, device))
    return rows


def lora_fused_call(
    y: torch.Tensor,
    x: torch.Tensor,
    flat_layer: torch.Tensor,
    meta: LoraMeta,
    modules: tuple[int, ...],
    offsets: tuple[int, ...],
    widths: tuple[int, ...],
) -> None:
    """The call with kernels/triton/lora_fused.py, one launch per run of fused modules (not the engine's kernels)."""
    for first, run_offsets, run_widths in lora_call.consecutive_runs(modules, offsets, widths):
        fused_lora(y, x, flat_layer, meta, first, run_offsets, run_widths)


def fused_settings() -> KernelSettings:
    """The benchmark's kernel settings with lora_fused on."""
    return dataclasses.replace(kernel_settings, lora_fused=True)


def other_grouping() -> tuple[str, KernelSettings]:
    """The impl name and settings of a step with decodes and prompts launched the other way than the benchmark's
    settings launch them: apart ("triton_split", KernelSettings.lora_split) or in one launch pair ("triton_pair")."""
    split = not kernel_settings.lora_split
    return ("triton_split" if split else "triton_pair"), dataclasses.replace(kernel_settings, lora_split=split)


GRAPH_MAX_SEQS = AUTO_SEQS[1]  # the most max_num_seqs resolves to on CUDA: its graphs' buckets (cuda_graphs.py)
GRAPH_MAX_RANK = EngineConfig.max_lora_rank  # the default: the cap of a graph's rank bound


def graph_meta(case: LoraCase) -> tuple[LoraMeta, int] | None:
    """A decode step's metadata as a CUDA graph replays it (executor/static_lora.py): static buffers of the smallest
    bucket that holds its tokens, launch grids of its power-of-two rank bound and tile kind, padding rows of no
    adapter; and that bucket's size. None for a step with prompts (eager in the engine)."""
    meta, n = case.meta, case.num_tokens
    if not case.decode_only:
        return None
    size = bucket_for(bucket_sizes(GRAPH_MAX_SEQS), n)
    bound = rank_bound(meta.max_rank, GRAPH_MAX_RANK)
    device = meta.token_adapter.device
    few = kernel_settings.few_adapters_max if meta.of_few_adapters(kernel_settings) else None
    static = StaticLora(size, size, meta.targeted_modules(), bound, meta.row_align, device, decode_tiling(size, few))
    static.fill(meta, n)
    return static.meta, size


def served_mixed_graphs(case: LoraCase) -> list[tuple[str, LoraMeta]]:
    """A saturated server's step with prompts (an eager case named SERVED_MIXED) as a graph of steps with prompts
    replays it (executor/mixed_graphs.py), with the LoRA launch groups the settings give it ("triton_graph") and the
    other way ("split_graph": decodes apart, graph_lora_split; "pair_graph": one launch group): its graph's sequence
    bucket, the step's own tokens (a token bucket's padding adds tiles of no token only). Nothing for other cases."""
    if not case.name.startswith(SERVED_MIXED) or case.decode_only or case.meta.static is not None:
        return []
    seqs = bucket_for(seq_buckets(GRAPH_MAX_SEQS), case.num_seqs)
    own = kernel_settings.graph_lora_split
    return [("triton_graph" if split == own else ("split_graph" if split else "pair_graph"),
             as_mixed_graph(case, seqs, split).meta) for split in (own, not own)]  # fmt: skip


def padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t with zero rows appended up to `rows` (a graph bucket's padding)."""
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


def bench_lora_call(
    case: LoraCase, device: Device, call: str, modules: tuple[int, ...], in_features: int, gen: torch.Generator
) -> list[Row]:
    offsets, widths = call_outputs(case.model, modules)
    x = torch.randn((case.num_tokens, in_features), generator=gen, device=DEVICE).to(torch.bfloat16)
    y0 = torch.randn((case.num_tokens, sum(widths)), generator=gen, device=DEVICE).to(torch.bfloat16)
    args = (x, case.flat_layer, case.meta, modules, offsets, widths)
    # impl -> (function, y before the call, its arguments after y)
    impls: dict[str, tuple[Callable[..., None], torch.Tensor, tuple[Any, ...]]] = {
        "triton": (TritonOps(kernel_settings).lora, y0, args),
        "torch_ref": (lora_ref, y0, args),
        "padded_bmm": (lora_padded_bmm, y0, args),
    }
    # The launches whose shrink and expand are also timed apart: (impl, its settings, y before the call, arguments)
    parts: list[tuple[str, KernelSettings, torch.Tensor, tuple[Any, ...]]] = []
    if not case.decode_only:  # a step with prompts: where its time goes, shrink or expand
        parts.append(("triton", kernel_settings, y0, args))
    if len(case.meta.groups(split=True)) > 1:  # decodes and prompts: also launched the other way (lora_split)
        name, settings = other_grouping()
        impls[name] = (TritonOps(settings).lora, y0, args)
        parts.append((name, settings, y0, args))
    # The fused kernel (shrink and expand in one) on every token, whatever the step; then as the engine launches it
    # (lora_fused: decodes of many adapters of rank up to its MAX_RANK, the rest on the pair)
    impls["triton_fused"] = (lora_fused_call, y0, args)
    impls["fused_engine"] = (TritonOps(fused_settings()).lora, y0, args)
    graph = graph_meta(case)
    if graph is not None:  # a decode step: also as a CUDA graph replays it (padded to its bucket, static metadata)
        meta, size = graph
        graph_args = (padded(x, size), case.flat_layer, meta, *args[3:])
        impls["triton_graph"] = (TritonOps(kernel_settings).lora, padded(y0, size), graph_args)
        impls["fused_graph"] = (TritonOps(fused_settings()).lora, padded(y0, size), graph_args)
        if case.name.startswith(SERVED_DECODE):  # the served decode steps, as their graph replays them
            parts.append(("triton_graph", kernel_settings, impls["triton_graph"][1], graph_args))
    for name, mixed_meta in served_mixed_graphs(case):  # the served step with prompts as its graph replays it
        graph_args = (x, case.flat_layer, mixed_meta, *args[3:])
        impls[name] = (TritonOps(kernel_settings).lora, y0, graph_args)
        parts.append((name, kernel_settings, y0, graph_args))
    nbytes, flops = lora_minimum(case, modules, in_features)
    if nbytes == 0:
        return []  # no adapter of the case targets these modules (S1 has no MLP adapters): nothing to time
    expected = y0.clone()
    lora_ref(expected, *args)
    rows = []
    for impl, (fn, y_start, fn_args) in impls.items():
        y = y_start.clone()
        fn(y, *fn_args)
        err = rel_err(y[: case.num_tokens], expected)
        ms, eager, how = timed(functools.partial(fn, y, *fn_args))
        row = Row(f"lora_{call}", case.name, impl, ms, nbytes, flops, max_rel_err=err, eager_ms=eager, timing=how)
        rows.append(finish(row, device))
    for impl, settings, y_start, part_args in parts:
        rows += lora_part_rows(case, device, call, in_features, impl, settings, y_start.clone(), part_args)
    return rows


def lora_part_rows(
    case: LoraCase,
    device: Device,
    call: str,
    in_features: int,
    impl: str,
    settings: KernelSettings,
    y: torch.Tensor,
    args: tuple[Any, ...],
) -> list[Row]:
    """The call's shrink launches alone and its expand launches alone ("<impl>:shrink", "<impl>:expand"), as `impl`
    launches them with `settings` (the launch pairs: lora_fused off); no error column (neither writes the call's
    result alone)."""
    x, flat_layer, meta, modules, offsets, widths = args
    settings = dataclasses.replace(settings, lora_fused=False)
    calls = [c for c in lora_call.lora_calls(y, x, flat_layer, meta, modules, offsets, widths, settings)
             if isinstance(c, lora_call.LoraCall)]  # fmt: skip

    def shrinks() -> None:
        for c in calls:
            c.shrink(x, flat_layer)

    def expands() -> None:
        for c in calls:
            c.expand(y, flat_layer)

    shrinks()  # the expands' v
    rows = []
    for part, fn, (nbytes, flops) in zip(("shrink", "expand"), (shrinks, expands),
                                         lora_part_minimums(case, modules, in_features)):  # fmt: skip
        ms, eager, how = timed(fn)
        rows.append(finish(Row(f"lora_{call}", case.name, f"{impl}:{part}", ms, nbytes, flops, eager_ms=eager,
                               timing=how), device))  # fmt: skip
    return rows


# ---------------------------------------------------------------- attention


@dataclass
class AttentionCase:
    name: str
    model: Model
    pool: PagePool
    meta: AttentionMeta
    q: torch.Tensor


def attention_case(name: str, model: Model, seqs: list[tuple[int, int]], block_size: int = 16) -> AttentionCase:
    """seqs: (new tokens, context length) per sequence."""
    geometry = PoolGeometry(1, block_size, model.kv_heads, model.head_dim)
    pool = scrambled_pool(geometry, sum(-(-n // block_size) for _, n in seqs) + 8, torch.bfloat16)
    scheduled = []
    for i, (q_len, ctx) in enumerate(seqs):
        pages = pool.alloc(-(-ctx // block_size), PageKind.KV, i)
        scheduled.append(ScheduledSeq(request(i, ctx, ctx - q_len, pages=pages), q_len))
    meta = build_batch(scheduled, block_size, DEVICE).attn
    q = torch.randn((meta.q_start_host[-1], model.heads, model.head_dim), device=DEVICE).to(torch.bfloat16)
    return AttentionCase(name, model, pool, meta, q)


def attention_minimum(case: AttentionCase) -> tuple[int, int]:
    m, es = case.model, 2
    visible = 0  # (query, key) pairs
    nbytes = 2 * case.q.numel() * es  # q read, out written
    for i, ctx in enumerate(case.meta.seq_lens_host):
        q_len = case.meta.q_start_host[i + 1] - case.meta.q_start_host[i]
        visible += q_len * ctx - q_len * (q_len - 1) // 2
        nbytes += 2 * ctx * m.kv_size * es
    return nbytes, 4 * visible * m.heads * m.head_dim


def bench_attention(case: AttentionCase, device: Device) -> list[Row]:
    kv_layer, scale = case.pool.kv_layer(0), case.model.head_dim**-0.5
    ops = TritonOps(kernel_settings)
    expected = paged_attention_ref(case.q, kv_layer, case.meta, scale)
    nbytes, flops = attention_minimum(case)
    kernel = "attention_decode" if case.meta.decode_only else "attention_prefill"
    rows = []
    impls = {"triton": ops.attention, "torch_ref": paged_attention_ref}
    for impl, fn in impls.items():
        err = rel_err(fn(case.q, kv_layer, case.meta, scale), expected)
        run = functools.partial(fn, case.q, kv_layer, case.meta, scale)
        ms, eager, how = timed(run, capturable=impl == "triton")  # the reference copies page lists to the GPU
        row = Row(kernel, case.name, impl, ms, nbytes, flops, max_rel_err=err, eager_ms=eager, timing=how)
        rows.append(finish(row, device))
    return rows


def bench_kv_write(case: AttentionCase, device: Device) -> list[Row]:
    m, n = case.model, case.meta.q_start_host[-1]
    k = torch.randn((n, m.kv_heads, m.head_dim), device=DEVICE).to(torch.bfloat16)
    v = torch.randn_like(k)
    kv_layer = case.pool.kv_layer(0)
    nbytes = 2 * 2 * k.numel() * 2  # k and v, read and written
    ops = TritonOps(kernel_settings)
    rows = []
    impls = {"triton": lambda: ops.write_kv(k, v, kv_layer, case.meta),
             "torch_ref": lambda: write_kv_ref(k, v, kv_layer, case.meta.slot_mapping)}  # fmt: skip
    for impl, fn in impls.items():
        ms, eager, how = timed(fn, capturable=impl == "triton")
        rows.append(finish(Row("kv_write", case.name, impl, ms, nbytes, 0, eager_ms=eager, timing=how), device))
    return rows


# ---------------------------------------------------------------- cases, table, targets

MIXED_RANKS = (1, 3, 8, 16, 64, 128)
TINY_MHA = Model("tiny-mha", 64, 96, 4, 4, 16)  # --smoke
TINY_GQA = Model("tiny-gqa", 64, 96, 4, 2, 16)


def adapters(ranks: list[int]) -> list[tuple[int, ...]]:
    return [(r,) * len(LORA_MODULES) for r in ranks]


S1 = (8, 8, 8, 8, 0, 0, 0)  # rank 8 on q, k, v, o (perf/make_adapters.py's S1)
S2_RANKS = (64, 32, 16, 8)  # S2: one of these ranks on q, k, v, o


def s2_adapters(count: int) -> list[tuple[int, ...]]:
    return [(r, r, r, r, 0, 0, 0) for r in itertools.islice(itertools.cycle(S2_RANKS), count)]


def sall_adapters(count: int) -> list[tuple[int, ...]]:
    """perf/make_adapters.py's S-all: S2's ranks on all seven projections."""
    return adapters(list(itertools.islice(itertools.cycle(S2_RANKS), count)))


def lora_cases(mha: Model, gqa: Model, n: int, prompt: int) -> list[Callable[[], LoraCase]]:
    """n requests decode (n adapters or 4; S2 also at 3n/2 + 1, as the engine's graph steps), a mixed step of 4
    prompts of `prompt` tokens + n/2 decodes, the engine's S1 mixed step (S1 n = 2000 in perf/RESULTS.md): 4 prompts
    of `prompt` tokens + 3n decodes, and S2's (n = 2000: 2 prompts of prompt/2 tokens + 2n decodes, about the replay
    profile's mixed steps), and a saturated server's step with prompts on the GQA model (served_mixed_sweep), each
    request with its own adapter."""
    mixed = [MIXED_RANKS[i % len(MIXED_RANKS)] for i in range(n + 4)]
    decode = [(i, 1) for i in range(n)]
    mixed_step = [(i, prompt) for i in range(4)] + [(4 + i, 1) for i in range(n // 2)]
    s1_step = [(i, prompt) for i in range(4)] + [(4 + i, 1) for i in range(3 * n)]
    s2_step = [(i, prompt // 2) for i in range(2)] + [(2 + i, 1) for i in range(2 * n)]
    s2_name = f"S2 mixed 2x{prompt // 2} prompt + {2 * n} decode, r64/32/16/8 q,k,v,o"
    s2_graph = 3 * n // 2 + 1  # n = 64: 97, as the S2 n = 2000 replay's graph steps (96-98 sequences, bucket 112)
    return [
        lambda: lora_case(f"S1 mixed 4x{prompt} prompt + {3 * n} decode, r8 q,k,v,o", mha, [S1] * (4 + 3 * n), s1_step),
        lambda: lora_case(f"decode {n} req, {n} adapters r16", mha, adapters([16] * n), decode),
        lambda: lora_case(f"decode {n} req, {n} adapters mixed r1-128", mha, adapters(mixed[:n]), decode),
        lambda: lora_case(f"decode {n} req, 4 adapters r64", mha, adapters([64] * 4), [(i % 4, 1) for i in range(n)]),
        lambda: lora_case(f"S2 decode {n} req, {n} adapters r64/32/16/8 q,k,v,o", mha, s2_adapters(n), decode),
        lambda: lora_case(f"S2 decode {n} req, 5 adapters", mha, s2_adapters(5), [(i % 5, 1) for i in range(n)]),
        lambda: lora_case(
            f"S2 decode {s2_graph} req, {s2_graph} adapters r64/32/16/8 q,k,v,o",
            mha,
            s2_adapters(s2_graph),
            [(i, 1) for i in range(s2_graph)],
        ),  # fmt: skip
        lambda: lora_case(
            f"S-all decode {s2_graph} req, {s2_graph} adapters r64/32/16/8 all seven",
            mha,
            sall_adapters(s2_graph),
            [(i, 1) for i in range(s2_graph)],
        ),  # fmt: skip
        lambda: lora_case(f"decode {n} req, {n} adapters mixed r1-128", gqa, adapters(mixed[:n]), decode),
        lambda: lora_case(
            f"mixed 4x{prompt} prompt + {n // 2} decode, mixed r1-128", mha, adapters(mixed[: 4 + n // 2]), mixed_step
        ),  # fmt: skip
        lambda: lora_case(s2_name, mha, s2_adapters(2 + 2 * n), s2_step),
        served_mixed_sweep(gqa, n)[1],  # a saturated server's step with prompts: its calls also the other way
        lambda: served_mixed_five(gqa, n),  # S1 n = 5's: also as its graph replays it, both ways
        lambda: served_decode_case(gqa, n, graph=False),  # its decode step: eager, and as its graph replays it
        lambda: served_decode_case(gqa, n, graph=False, adapters=5),  # S1 n = 5's: the LoRA launches' fixed cost
        # the launches' latency floor: one token of a rank-1 adapter reads next to nothing, so its time is what a
        # layer's LoRA launches cost however few bytes they move (4 launches on q,k,v,o; 8 on all seven projections)
        lambda: lora_case("floor: decode 1 req, 1 adapter r1 q,k,v,o", mha, [(1, 1, 1, 1, 0, 0, 0)], [(0, 1)]),
        lambda: lora_case("floor: decode 1 req, 1 adapter r1", mha, adapters([1]), [(0, 1)]),
    ]


def attention_cases(mha: Model, gqa: Model, n: int, ctx: int) -> list[Callable[[], AttentionCase]]:
    """n decodes of contexts ctx/8 .. ctx, 4 long decodes (split), prompts, a chunk with decodes, and a saturated
    server's step with prompts: 4n decodes beside two prompts, on the GQA model."""
    rng = random.Random(1)
    lengths = [rng.randint(ctx // 8, ctx) for _ in range(n)]
    many = [(1, rng.randint(ctx // 8, ctx)) for _ in range(4 * n)] + [(ctx // 8, ctx // 8)] * 2
    return [
        lambda: attention_case(f"{DECODES_WITH_PROMPTS} ({4 * n}, ctx {ctx // 8}-{ctx}, 2 prompts)", gqa, many),
        lambda: attention_case(f"decode {n} seq, ctx {ctx // 8}-{ctx}", mha, [(1, c) for c in lengths]),
        lambda: attention_case(f"decode {n} seq, ctx {ctx // 8}-{ctx}", gqa, [(1, c) for c in lengths]),
        lambda: attention_case(f"decode 4 seq, ctx {4 * ctx} (split)", gqa, [(1, 4 * ctx)] * 4),
        lambda: attention_case(f"prefill 4x{ctx // 4} prompts", mha, [(ctx // 4, ctx // 4)] * 4),
        lambda: attention_case(
            f"chunk {ctx // 8} on {ctx} + {n // 2} decodes", gqa, [(ctx // 8, ctx)] + [(1, ctx // 2)] * (n // 2)
        ),  # fmt: skip
    ]


def check_targets(rows: list[Row]) -> list[dict[str, object]]:
    checks: list[dict[str, object]] = []
    by_key = {(r.kernel, r.case, r.impl): r for r in rows}
    for r in rows:
        if r.impl != "triton":
            continue
        decodes = r.case.startswith(("decode", "S2 decode", "S-all decode", DECODES_WITH_PROMPTS))
        if r.kernel in ("lora_layer", "attention_decode", "attention_prefill") and decodes:
            same_size = r.frac_same_size_copy
            checks.append({"target": f"{r.kernel} [{r.case}] >= {DECODE_BW_TARGET:.0%} of copy bandwidth",
                           "value": round(r.frac_copy, 3), "met": r.frac_copy >= DECODE_BW_TARGET,
                           "vs_same_size_copy": None if same_size is None else round(same_size, 3)})  # fmt: skip
        padded = by_key.get((r.kernel, r.case, "padded_bmm"))
        if r.kernel == "lora_layer" and "mixed r1-128" in r.case and padded is not None:
            speedup = padded.ms / r.ms
            checks.append({"target": f"lora_layer [{r.case}] >= {PADDED_SPEEDUP_TARGET:.0f}x padded bmm",
                           "value": round(speedup, 2), "met": speedup >= PADDED_SPEEDUP_TARGET})  # fmt: skip
    return checks


def table(rows: list[Row]) -> str:
    head = f"{'kernel':<17} {'case':<58} {'impl':<10} {'ms':>9} {'eager ms':>9} {'GB/s':>7} {'TFLOP/s':>7} "
    head += f"{'%copy':>6} {'%sscp':>6} {'%mm':>6} {'vs triton':>9} {'err':>7}"
    lines = [head, "-" * len(head)]
    triton_ms = {(r.kernel, r.case): r.ms for r in rows if r.impl == "triton"}
    for r in rows:
        ratio = r.ms / triton_ms.get((r.kernel, r.case), r.ms)
        err = "" if r.max_rel_err is None else f"{r.max_rel_err:.0e}"
        same = "" if r.frac_same_size_copy is None else f"{100 * r.frac_same_size_copy:.0f}%"
        lines.append(
            f"{r.kernel:<17} {r.case[:58]:<58} {r.impl:<10} {r.ms:>9.4f} {r.eager_ms:>9.4f} "
            f"{r.gbps:>7.0f} {r.tflops:>7.1f} {100 * r.frac_copy:>5.0f}% {same:>6} {100 * r.frac_matmul:>5.1f}% "
            f"{ratio:>8.1f}x {err:>7}"
        )
    return "\n".join(lines) + "\n"


def run_all(smoke: bool, only: str | None = None, case: str | None = None) -> tuple[Device, list[Row]]:
    """Every case's rows (only: the LoRA or the attention cases; case: those whose name contains it)."""
    device = measure_device(smoke)
    if smoke:
        lcases, acases = lora_cases(TINY_MHA, TINY_GQA, 4, 20), attention_cases(TINY_MHA, TINY_GQA, 4, 64)
    else:
        lcases, acases = lora_cases(LLAMA_7B, GQA_8B, 64, 512), attention_cases(LLAMA_7B, GQA_8B, 64, 4096)
    logger.info("%s: copy %.0f GB/s, bf16 matmul %.0f TFLOP/s", device.name, device.copy_gbps, device.matmul_tflops)
    if only == "lora":
        acases = []
    elif only == "attention":
        lcases = []
    rows: list[Row] = []
    for make_lora in lcases:
        lcase = make_lora()
        if case is not None and case not in lcase.name:
            continue
        logger.info("lora: %s @%s", lcase.name, lcase.model.name)
        rows += tagged(bench_lora(lcase, device), lcase.model)
    for make_attention in acases:
        acase = make_attention()
        if case is not None and case not in acase.name:
            continue
        logger.info("attention: %s @%s", acase.name, acase.model.name)
        rows += tagged(bench_attention(acase, device) + bench_kv_write(acase, device), acase.model)
        del acase
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    for row in rows:
        if row.impl == "triton" and row.min_bytes:
            row.same_size_copy_ms = same_size_copy_ms(row.min_bytes)
    return device, rows


def tagged(rows: list[Row], model: Model) -> list[Row]:
    for r in rows:
        r.case = f"{r.case} @{model.name}"
    return rows


# ---------------------------------------------------------------- --tune: config sweeps for the hot kernels


def sweep(
    kernel: str,
    module: Any,
    attr: str,
    variants: list[Any],
    run: Callable[[], object],
    shown: Callable[[Any], Any] = lambda v: v,
) -> list[dict[str, Any]]:
    """Time `run` with module.<attr> (a config table) set to each variant in turn; the original is restored.

    A variant that cannot run (e.g. too much shared memory) is recorded with its error instead of a time.
    """
    return sweep_tables(kernel, [(module, attr)], [(v,) for v in variants], run, lambda v: shown(v[0]))


def sweep_tables(
    kernel: str,
    tables: list[tuple[Any, str]],
    variants: list[tuple[Any, ...]],
    run: Callable[[], object],
    shown: Callable[[tuple[Any, ...]], Any] = lambda v: v,
) -> list[dict[str, Any]]:
    """sweep with several config tables (module, attr) set together, one value each per variant (a shrink and the
    expand that must read its output); the originals are restored."""
    originals = [getattr(module, attr) for module, attr in tables]
    baseline = timed(run)[0]
    results: list[dict[str, Any]] = []
    try:
        for variant in variants:
            for (module, attr), value in zip(tables, variant, strict=True):
                setattr(module, attr, value)
            entry: dict[str, Any] = {"kernel": kernel, "config": repr(shown(variant))}
            try:
                entry["ms"] = timed(run)[0]
                entry["vs_default"] = baseline / entry["ms"]
            except Exception as exc:  # noqa: BLE001 - a config that does not fit is a result, not a failure
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            results.append(entry)
            # as it goes: a sweep cut short by a time limit still leaves what it measured
            logger.info("%s %d/%d: %s %s", kernel, len(results), len(variants),
                        f"{entry['ms']:.4f} ms" if "ms" in entry else entry["error"], entry["config"])  # fmt: skip
    finally:
        for (module, attr), value in zip(tables, originals, strict=True):
            setattr(module, attr, value)
    return sorted(results, key=lambda r: r.get("ms", float("inf")))


def tune_lora(label: str, case: LoraCase, call: int = 0, expand_only: bool = False) -> list[dict[str, Any]]:
    """Shrink and expand config sweeps of one LoRA call of `case` (lora_calls: 0 = q/k/v, 1 = o, 3 = down), each
    variant's launches built afresh. Calls of one module sweep their own decode configs (DECODE_ONE). expand_only:
    the mixed expand's candidates alone (mixed_expand_variants), for any call of a step with prompts and decodes."""
    name, modules, lora = lora_runner(case, call)
    kind = case.meta.whole().kind(kernel_settings)
    attr = {"decode": "DECODE", "mixed": "MIXED", "prompts": "PREFILL"}[kind]  # the config it uses
    if expand_only:
        if kind != "mixed":
            raise ValueError(f"the expand-only sweep is of steps with prompts and decodes, not of a {kind} step")
        return sweep(f"lora_expand ({label} {name})", lora_expand, attr, mixed_expand_variants(), lora)
    if len(modules) == 1:
        if kind != "decode":
            raise ValueError(f"one-module calls are swept on decode steps only, not on a {kind} step")
        shrink, expand, attr = single_module_variants(), single_module_expand_variants(), "DECODE_ONE"
    else:
        shrink, expand = fused_variants(), fused_expand_variants()
    results = sweep(f"lora_shrink ({label} {name})", lora_shrink, attr, shrink, lora)
    return results + sweep(f"lora_expand ({label} {name})", lora_expand, attr, expand, lora)


def lora_runner(case: LoraCase, call: int) -> tuple[str, tuple[int, ...], Callable[[], None]]:
    """(call name, modules, a function that runs that LoRA call of `case` with the config tables as they are)."""
    name, modules, in_features = lora_calls(case.model)[call]
    offsets, widths = call_outputs(case.model, modules)
    x = torch.randn((case.num_tokens, in_features), device=DEVICE).to(torch.bfloat16)
    y = torch.zeros((case.num_tokens, sum(widths)), device=DEVICE).to(torch.bfloat16)
    # One launch pair for a step's decodes and prompts: the MIXED configs swept here are that pair's (with
    # lora_split the step's decodes and prompts would take the DECODE and PREFILL configs instead).
    ops = TritonOps(dataclasses.replace(kernel_settings, lora_split=False))

    def lora() -> None:
        case.meta.launches.clear()  # the launches a step keeps were built with the previous variant
        ops.lora(y, x, case.flat_layer, case.meta, modules, offsets, widths)

    return name, modules, lora


def tune_few_decode(case: LoraCase, call: int) -> list[dict[str, Any]]:
    """Config sweeps of one LoRA call of a decode step of few adapters (KernelSettings.few_adapters: the MIXED
    tables' 16-token tensor-core tiles): the shrink's candidates (few_shrink_variants), the expand's
    (mixed_expand_variants), and the GEMV kernels on the same tiles for both (their shrink leaves K-split partials
    that only the GEMV expand reads)."""
    name, _, lora = lora_runner(case, call)
    kind = case.meta.whole().kind(kernel_settings)
    if kind != "mixed" or not case.decode_only:
        raise ValueError(f"the few adapters' sweep is of decode steps of few adapters, not of a {kind} step")
    label = f"{case.name} {name}"
    results = sweep(f"lora_shrink ({label})", lora_shrink, "MIXED", few_shrink_variants(), lora)
    results += sweep(f"lora_expand ({label})", lora_expand, "MIXED", mixed_expand_variants(), lora)
    tables = [(lora_shrink, "MIXED"), (lora_expand, "MIXED")]
    return results + sweep_tables(f"lora_shrink+expand GEMV ({label})", tables, few_gemv_pairs(), lora)


def few_shrink_variants() -> list[ShrinkConfig]:
    """Tensor-core shrink configs around MIXED on its 16-token tiles (a graph's static tile table fixes block_m):
    fewer programs (fewer K splits: a shorter reduction by the last split), longer or shorter K blocks, other rank
    chunks, warps and stages."""
    base = lora_shrink.MIXED
    shrink = [dataclasses.replace(base, target_programs=tp) for tp in (32, 64, 128, 256, 1024)]
    shrink += [dataclasses.replace(base, block_k=bk, target_programs=tp) for bk in (64, 256) for tp in (128, 512)]
    shrink += [dataclasses.replace(base, block_r=br) for br in (16, 64)]
    shrink += [dataclasses.replace(base, num_warps=w) for w in (2, 8)]
    shrink += [dataclasses.replace(base, num_stages=st) for st in (2, 4)]
    return shrink + [base]


def few_gemv_pairs() -> list[tuple[ShrinkConfig, ExpandConfig]]:
    """GEMV shrink and expand on MIXED's 16-token tiles: A read from cache for a tile's later tokens, no semaphore
    reduction (the expand sums the K splits' partials)."""
    block_m = lora_shrink.MIXED.block_m
    expand = ExpandConfig(block_m, 16, (1024,), 1024, 4, 2, gemv=True)
    return [(ShrinkConfig(block_m, br, bk, 1 << 20, w, 2, gemv=True), expand)
            for br in (16, 32) for bk in (256, 512, 1024) for w in (4, 8)]  # fmt: skip


# Each variant compiles (about a second on the H200 host): grids around the defaults, not every combination.
def fused_variants() -> list[ShrinkConfig]:
    """The GEMV shrink configs of fused calls, and the tensor-core kernels' decode configs to compare with."""
    shrink = [ShrinkConfig(1, br, bk, 1 << 20, w, 2, gemv=True) for br in (16, 32) for bk in (256, 512, 1024)
              for w in (4, 8)]  # fmt: skip
    shrink += [dataclasses.replace(lora_shrink.DECODE, target_programs=tp) for tp in (512, 1024)]
    shrink += [dataclasses.replace(lora_shrink.DECODE, block_m=bm) for bm in (2, 4, 8, 16)]
    shrink += [dataclasses.replace(lora_shrink.MIXED, block_m=bm) for bm in (32, 64)]  # prompts in fewer tiles
    return shrink + [lora_shrink.MIXED]


def gemv_expand_variants() -> list[ExpandConfig]:
    """GEMV expand configs: rank chunks, column blocks, warps."""
    return [ExpandConfig(1, br, (bn,), 1024, w, 2, gemv=True) for br in (8, 16, 32) for bn in (512, 1024)
            for w in (2, 4)]  # fmt: skip


def fused_expand_variants() -> list[ExpandConfig]:
    expand = gemv_expand_variants() + [dataclasses.replace(lora_expand.DECODE, num_warps=8, block_n=(2048,))]
    expand += [dataclasses.replace(lora_expand.DECODE, block_m=bm) for bm in (2, 4, 8, 16)]
    expand += [dataclasses.replace(lora_expand.MIXED, block_n=(bn,)) for bn in (64, 128, 256)]
    expand += [dataclasses.replace(lora_expand.MIXED, block_m=bm) for bm in (32, 64)]
    # programs of several column blocks: fewer programs for steps of many one-token tiles
    expand += [dataclasses.replace(lora_expand.MIXED, block_n=(bn,), n_chunks=c)
               for bn in (128, 256) for c in (2, 4, 8)]  # fmt: skip
    return expand + [lora_expand.MIXED]


def mixed_expand_variants() -> list[ExpandConfig]:
    """Candidates for the expand of steps with prompts and decodes: the GEMV kernel on the shrink's 16-token tiles
    (what a graph of such steps can replay: one tile table for both kernels) and on one-token tiles, narrow rank
    chunks (S1's rank 8), the tensor-core kernel with Bᵀ read ahead (prefetch) and several column blocks a program,
    and the tensor-core default."""
    expand = [ExpandConfig(lora_shrink.MIXED.block_m, br, (bn,), 1024, w, 2, gemv=True)
              for br in (8, 16) for bn in (512, 1024) for w in (2, 4)]  # fmt: skip
    expand += [ExpandConfig(1, br, (1024,), 1024, w, 2, gemv=True) for br, w in ((8, 2), (16, 4))]
    # the tensor-core kernel reading its first Bᵀ chunk before it waits for the shrink, alone and with programs of
    # several column blocks
    expand += [dataclasses.replace(lora_expand.MIXED, prefetch=True)]
    expand += [dataclasses.replace(lora_expand.MIXED, block_n=(128,), n_chunks=c, prefetch=p)
               for c in (2, 4) for p in (False, True)]  # fmt: skip
    return expand + [lora_expand.MIXED]


def single_module_variants() -> list[ShrinkConfig]:
    """GEMV shrink configs of one-module decode calls: shorter K blocks (more splits, so more programs), wider rank
    chunks; tiles stay one token (the decode graphs' static tile table)."""
    shrink = [ShrinkConfig(1, br, bk, 1 << 20, w, 2, gemv=True) for br in (8, 16, 32) for bk in (256, 512, 1024)
              for w in (2, 4)]  # fmt: skip
    return shrink + [ShrinkConfig(1, 16, bk, 1 << 20, 8, 2, gemv=True) for bk in (512, 2048)]


def single_module_expand_variants() -> list[ExpandConfig]:
    """GEMV expand configs of one-module decode calls, and narrower column blocks (more programs)."""
    return gemv_expand_variants() + [dataclasses.replace(lora_expand.DECODE, block_n=(256,), num_warps=w)
                                     for w in (2, 4)]  # fmt: skip


SERVED_MIXED = "served mixed"
SERVED_MIXED_EXPAND = "served mixed expand"  # its expand candidates on S1, S2 and S1 over 5 adapters, q/k/v and o
SERVED_DECODE = "served decode"  # a saturated server's decode step (served_decode_case), q/k/v and o
SERVED_DECODE_FEW = "served decode few"  # that step over 5 adapters (S1 n = 5's) as its graph replays it


def served_mixed_sweep(gqa: Model, n: int) -> tuple[str, Callable[[], LoraCase]]:
    """A saturated server's step with prompts on the GQA shape (S1 n = 2000 served, perf/RESULTS.md: ~460
    sequences, ~840 prompt tokens, each request on its own adapter): 7n + 12 decodes beside two prompts of 13n/2 + 4
    tokens (n = 64: 460 and 420)."""
    decodes, _ = served_mixed_shape(n)
    label = served_mixed_label(n)
    return label, lambda: lora_case(label, gqa, [S1] * (decodes + 2), served_mixed_steps(n)[0])


def served_mixed_label(n: int) -> str:
    decodes, prompt = served_mixed_shape(n)
    return f"{SERVED_MIXED} {decodes} decode + 2x{prompt} prompt S1"


def served_mixed_steps(n: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The served step with prompts' (adapter, tokens) sequences with an adapter a request, and over 5 adapters
    (S1 n = 5's: every decode of an adapter in one segment with its prompt)."""
    decodes, prompt = served_mixed_shape(n)
    many = [(i, 1) for i in range(decodes)] + [(decodes + i, prompt) for i in range(2)]
    few = [(i % 5, 1) for i in range(decodes)] + [(i, prompt) for i in range(2)]
    return many, few


def served_mixed_five(gqa: Model, n: int) -> LoraCase:
    """The served step with prompts over 5 adapters, eager (S1 n = 5's)."""
    label = served_mixed_label(n).replace(" S1", " S1, 5 adapters")
    return lora_case(label, gqa, [S1] * 5, served_mixed_steps(n)[1])


def served_mixed_shape(n: int) -> tuple[int, int]:
    """(decodes, tokens of each of its two prompts) of the served step with prompts (served_mixed_sweep)."""
    return 7 * n + 12, 13 * n // 2 + 4


def served_mixed_variants(gqa: Model, n: int) -> list[tuple[str, Callable[[], LoraCase]]]:
    """The served step with prompts (served_mixed_sweep) as S1 with an adapter a request, as S2 (ranks 64/32/16/8)
    likewise, as S1 over 5 adapters (n = 5: every decode of an adapter in one segment, tiles of 16 tokens), and its
    decodes alone over 5 adapters (KernelSettings.few_adapters: the same configs): a config for such steps must not
    lose on any of them, since one graph of steps with prompts serves them all."""
    label, s1 = served_mixed_sweep(gqa, n)
    decodes, _ = served_mixed_shape(n)
    many, few = served_mixed_steps(n)
    s2_label = label.replace(" S1", " S2 r64/32/16/8")
    # Eager, a step of few adapters has long segments (prompt tiles); graphs with one LoRA launch group (the
    # default, graph_lora_split off: these sweeps tune that group's mixed configs) replay it on the mixed configs.
    five_label = label.replace(" S1", " S1, 5 adapters, as a graph")
    decode_label = f"{SERVED_MIXED} {decodes} decode S1, 5 adapters, as a graph"
    return [
        (label, s1),
        (s2_label, lambda: lora_case(s2_label, gqa, s2_adapters(decodes + 2), many)),
        (five_label, lambda: as_mixed_graph(lora_case(five_label, gqa, [S1] * 5, few), len(few), split=False)),
        (decode_label, lambda: as_decode_graph(lora_case(decode_label, gqa, [S1] * 5, few[:decodes]))),
    ]


def served_decode_case(gqa: Model, n: int, graph: bool = True, adapters: int | None = None) -> LoraCase:
    """A saturated server's decode step on the GQA shape (S1 n = 2000 served, perf/RESULTS.md: ~370 sequences a
    decode step, each on its own adapter): 6n - 12 decodes (n = 64: 372), as their CUDA graph replays them (graph)
    or as an eager step's metadata. adapters: the decodes spread over that many adapters instead (S1 n = 5's step,
    whose adapters' bytes are negligible next to its x and y)."""
    decodes = 6 * n - 12
    count = decodes if adapters is None else adapters
    label = f"{SERVED_DECODE} {decodes} decode S1" + ("" if adapters is None else f", {adapters} adapters")
    case = lora_case(label, gqa, [S1] * count, [(i % count, 1) for i in range(decodes)])
    return as_decode_graph(case) if graph else case


def tune_fused(case: LoraCase, call: int) -> list[dict[str, Any]]:
    """FusedConfig sweep of the fused LoRA kernel (kernels/triton/lora_fused.py) on one call of `case`."""
    name, modules, in_features = lora_calls(case.model)[call]
    offsets, widths = call_outputs(case.model, modules)
    x = torch.randn((case.num_tokens, in_features), device=DEVICE).to(torch.bfloat16)
    y = torch.zeros((case.num_tokens, sum(widths)), device=DEVICE).to(torch.bfloat16)
    variants = [FusedConfig(bm, bk, bn, w, 2) for bm in (1, 16) for bk, bn in ((256, 256), (512, 512), (1024, 1024))
                for w in (2, 4, 8)]  # fmt: skip
    # A graph's rank bound (16 for rank-8 adapters) halves the steps of the default max_tile: also twice the tile
    variants += [FusedConfig(1, 1024, 1024, w, 2, max_tile=16384) for w in (2, 4, 8)]
    run = functools.partial(lora_fused_call, y, x, case.flat_layer, case.meta, modules, offsets, widths)
    return sweep(f"lora_fused ({case.name} {name})", lora_fused, "DEFAULT", variants, run)


def as_mixed_graph(case: LoraCase, seqs: int, split: bool | None = None) -> LoraCase:
    """The case's step as a graph of steps with prompts replays it (executor/mixed_graphs.py): static buffers for
    its tokens and `seqs` sequences, its LoRA in the launch groups of static_lora.mixed_tiling (split: the
    benchmark's settings' graph_lora_split when None; a split step of few adapters gets their variant)."""
    meta = case.meta
    bound = rank_bound(meta.max_rank, GRAPH_MAX_RANK)
    split = kernel_settings.graph_lora_split if split is None else split
    few = kernel_settings.few_adapters_max if split and meta.of_few_adapters(kernel_settings) else None
    tiling = mixed_tiling(case.num_tokens, seqs, split, few)
    static = StaticLora(case.num_tokens, seqs, meta.targeted_modules(), bound, meta.row_align,
                        meta.token_adapter.device, tiling)  # fmt: skip
    static.fill(meta, case.num_tokens)
    return dataclasses.replace(case, meta=static.meta)


def as_decode_graph(case: LoraCase) -> LoraCase:
    """A decode step's case as its CUDA graph replays it (graph_meta); its tokens are the bucket's."""
    graphed = graph_meta(case)
    assert graphed is not None, "a decode step"
    meta, size = graphed
    return dataclasses.replace(case, meta=meta, num_tokens=size)


def tune(smoke: bool, only: str | None = None, lora_case_of: str | None = None) -> list[dict[str, Any]]:
    """Sweep the decode LoRA configs on S1-like (rank 8 on q, k, v, o, one adapter per token) and mixed-rank
    decode steps, and the decode and prefill attention configs, on one representative case each; lora_case_of
    (SERVED_MIXED, SERVED_DECODE, SERVED_DECODE_FEW, SERVED_MIXED_EXPAND): that case's LoRA sweeps alone."""
    mha, gqa, n, ctx = (TINY_MHA, TINY_GQA, 4, 64) if smoke else (LLAMA_7B, GQA_8B, 64, 4096)
    results: list[dict[str, Any]] = []
    if lora_case_of == SERVED_MIXED:
        label, make = served_mixed_sweep(gqa, n)
        return tune_lora(label, make())
    if lora_case_of == SERVED_DECODE:
        case = served_decode_case(gqa, n)
        results = tune_lora(case.name, case, 0) + tune_lora(case.name, case, 1)
        graphed = dataclasses.replace(case, name=f"{case.name}, as a graph")  # as lora_fused's decode graphs run it
        results += tune_fused(graphed, 0) + tune_fused(graphed, 1)
        for make_case in (lambda: served_decode_case(gqa, n, graph=False), served_mixed_sweep(gqa, n)[1]):
            eager = make_case()
            results += tune_fused(eager, 0) + tune_fused(eager, 1)
        return results
    if lora_case_of == SERVED_DECODE_FEW:
        # the smoke shape's 12 decodes are too few for few_adapters' tensor-core tiles: 36 (n = 8)
        case = served_decode_case(gqa, 8 if smoke else n, adapters=5)
        return tune_few_decode(case, 0) + tune_few_decode(case, 1)
    if lora_case_of == SERVED_MIXED_EXPAND:
        for label, make in served_mixed_variants(gqa, n):
            built: LoraCase | None = None  # once for both calls
            for call in (0, 1):  # q/k/v, o
                try:
                    built = make() if built is None else built
                    results += tune_lora(label, built, call, expand_only=True)
                except Exception as exc:  # noqa: BLE001 - one case that cannot run must not lose the others
                    logger.exception("%s: no sweep", label)
                    results.append({"kernel": f"lora_expand ({label} call {call})", "config": "-",
                                    "error": f"{type(exc).__name__}: {str(exc)[:200]}"})  # fmt: skip
        return results
    if only in (None, "lora"):
        mixed = [MIXED_RANKS[i % len(MIXED_RANKS)] for i in range(n)]
        results += tune_lora("S1 decode", lora_case("tune", mha, [S1] * (2 * n), [(i, 1) for i in range(2 * n)]))
        few = [(i % 5, 1) for i in range(2 * n)]  # S1 at n = 5: many decodes per adapter
        results += tune_lora("S1 decode, 5 adapters", lora_case("tune", mha, [S1] * 5, few))
        results += tune_lora("mixed-rank decode", lora_case("tune", mha, adapters(mixed), [(i, 1) for i in range(n)]))
        s1_mixed = [(i, 1) for i in range(2 * n)] + [(2 * n + i, 4 * n) for i in range(4)]  # decodes and prompts
        results += tune_lora("S1 mixed", lora_case("tune", mha, [S1] * (2 * n + 4), s1_mixed))
        r16 = lora_case("tune", mha, [(16,) * 7] * n, [(i, 1) for i in range(n)])
        mixed_all = lora_case("tune", mha, adapters(mixed), [(i, 1) for i in range(n)])
        for call in (1, 3):  # o and down: one module each
            results += tune_lora("r16 decode", r16, call) + tune_lora("mixed-rank decode", mixed_all, call)
    if only == "lora":
        return results
    rng = random.Random(1)
    decode = attention_case("tune", mha, [(1, rng.randint(ctx // 8, ctx)) for _ in range(n)])
    prefill = attention_case("tune", mha, [(ctx // 4, ctx // 4)] * 4)
    ops, scale = TritonOps(kernel_settings), mha.head_dim**-0.5
    dec_configs = [{**paged_decode.CONFIGS, 2: DecodeConfig(bn, 256, 64, pps, w, st)}
                   for bn in (32, 64, 128) for pps in (4, 8, 16) for w in (4, 8) for st in (2, 3)]  # fmt: skip
    pre_configs = [{**paged_attention.CONFIGS, (2, False): AttentionConfig(bm, bn, w, 2)}
                   for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8)]  # fmt: skip
    results += sweep("attention_decode", paged_decode, "CONFIGS", dec_configs,
                     lambda: ops.attention(decode.q, decode.pool.kv_layer(0), decode.meta, scale),
                     shown=lambda v: v[2])  # fmt: skip

    def prefill_attention() -> None:
        prefill.meta.launches.clear()  # built with the previous variant
        ops.attention(prefill.q, prefill.pool.kv_layer(0), prefill.meta, scale)

    results += sweep("attention_prefill", paged_attention, "CONFIGS", pre_configs, prefill_attention,
                     shown=lambda v: v[(2, False)])  # fmt: skip
    return results


def tune_table(results: list[dict[str, Any]], top: int = 3) -> str:
    lines = ["", "fastest configs per kernel (ms; speedup over the current default):"]
    for kernel in dict.fromkeys(r["kernel"] for r in results):
        for r in [r for r in results if r["kernel"] == kernel and "ms" in r][:top]:
            lines.append(f"  {kernel:<26} {r['ms']:>9.4f} ms {r['vs_default']:>5.2f}x  {r['config']}")
        failed = sum(1 for r in results if r["kernel"] == kernel and "error" in r)
        if failed:
            lines.append(f"  {kernel:<26} {failed} config(s) could not run (see the JSON)")
    return "\n".join(lines) + "\n"


def settings_of(options: list[str], parser: argparse.ArgumentParser) -> KernelSettings:
    """The kernel settings of --engine-option KEY=VALUE items (EngineConfig's fields and validation)."""
    values = {}
    for item in options:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--engine-option expects KEY=VALUE, got {item!r}")
        values[key.strip()] = value.strip()
    try:
        return EngineConfig.from_dict(values).kernel_settings()
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    global DEVICE, flush_mode, spread_pages, kernel_settings
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the results")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one call each (CPU: Triton interpreter)")
    parser.add_argument("--tune", action="store_true", help="also sweep the hot kernels' configs (about 3 more min)")
    parser.add_argument("--only", choices=("lora", "attention"), help="run only the LoRA or the attention cases")
    parser.add_argument("--case", help="run only the cases whose name contains this (e.g. 'served')")
    parser.add_argument("--tune-case", choices=(SERVED_MIXED, SERVED_MIXED_EXPAND, SERVED_DECODE, SERVED_DECODE_FEW),
                        help="sweep only this LoRA case's configs (a saturated server's step with prompts, GQA, "
                             "S1; 'expand': the mixed expand's candidates on it as S1, S2 and S1 over 5 adapters, "
                             "q/k/v and o calls; 'served decode': its decode step as a graph, q/k/v and o; 'few': "
                             "that step over 5 adapters, the few adapters' tiles), no benchmark rows")  # fmt: skip
    parser.add_argument(
        "--flush",
        choices=FLUSH_MODES,
        default="read",
        help="how the L2 is flushed before each timed call (read: clean; write: dirty, as before)",
    )
    parser.add_argument("--spread-pages", type=int, default=0,
                        help="LoRA cases: scatter the adapters' pages over a pool of at least this many pages "
                             "(the engine's: results.json pool_pages), against the default compact pool")  # fmt: skip
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a kernel field of EngineConfig (few_adapters_min_tokens, few_adapters_max, lora_split, "
                             "triton_gemm, lora_pdl, shrink_pdl), e.g. lora_pdl=false")  # fmt: skip
    args = parser.parse_args(argv)
    kernel_settings = settings_of(args.engine_option, parser)
    flush_mode = args.flush
    if args.spread_pages < 0:
        parser.error(f"--spread-pages must be >= 0, got {args.spread_pages}")
    spread_pages = args.spread_pages
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not torch.cuda.is_available():
        if not args.smoke:
            logger.error("bench_kernels needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
            return 2
        DEVICE = torch.device("cpu")
    torch.manual_seed(0)
    logger.info(
        "LoRA expand launched with PDL: %s (--engine-option lora_pdl=false turns it off), shrink: %s "
        "(shrink_pdl=false)", pdl.pdl_enabled(DEVICE, kernel_settings), pdl.shrink_pdl(DEVICE, kernel_settings),
    )  # fmt: skip
    rows: list[Row] = []
    if args.tune_case:  # that sweep alone
        args.tune = True
        device = measure_device(args.smoke)
    else:
        device, rows = run_all(args.smoke, args.only, args.case)
        if not rows:
            parser.error(f"no case's name contains {args.case!r}")
    checks = check_targets(rows)
    sys.stdout.write(table(rows))
    for check in checks:
        sys.stdout.write(f"{'MET   ' if check['met'] else 'MISSED'}  {check['target']}: {check['value']}\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {
        "device": asdict(device),
        "flush": flush_mode,
        "settings": asdict(kernel_settings),
        "lora_pdl": pdl.pdl_enabled(DEVICE, kernel_settings),
        "shrink_pdl": pdl.shrink_pdl(DEVICE, kernel_settings),
        "rows": [asdict(r) for r in rows],
        "targets": checks,
    }
    args.out.write_text(json.dumps(payload, indent=1))
    logger.info("wrote %s", args.out)
    if args.tune:
        payload["tuning"] = tune(args.smoke, args.only, args.tune_case)
        sys.stdout.write(tune_table(payload["tuning"]))
        args.out.write_text(json.dumps(payload, indent=1))
        logger.info("added the sweeps to %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
