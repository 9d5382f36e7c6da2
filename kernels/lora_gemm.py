"""A Triton GEMM for decode steps' projections, y = x·Wᵀ (+ bias) (gemm_launch), and the same with the projection's
LoRA in one launch, y += ((x_t·Aᵀ_t)·Bᵀ_t)·scale_t for each token t (lora_gemm_launch).

A decode step's LoRA call site costs a base GEMM, a shrink and an expand: three launches, each a few microseconds of
fixed cost even in a CUDA graph, which is most of the LoRA's time when few adapters share the step (a layer's four
call sites cost ~25 µs however little they read, perf/RESULTS.md session 13). This kernel does all three in one
launch with two kinds of programs, told apart by the order in which they start (a ticket from an atomic counter):

- shrink programs, the first num_tiles × splits tickets: v = x·Aᵀ for one tile's tokens over one split of K, for
  the rank rows of the call's modules of the tile's adapter (q's ranks first, then k's, then v's). The last split of
  a tile to finish (an arrival count) sums the splits' partials into split 0 and counts the tile done;
- GEMM programs, the other tickets: BLOCK_N columns of x·Wᵀ for BLOCK_M rows over all of K, while the shrink runs.
  Then each waits until every tile is done, adds every tile's v·Bᵀ·scale over its columns (the Bᵀ row offsets
  were fetched before the K loop) and stores y once. The last one to finish resets the counters for the next
  launch (the next layer, the next graph replay).

A GEMM program waits only for programs that hold earlier tickets, so have started and wait for nothing: the launch
cannot deadlock whatever order the GPU schedules its programs in, and under the CPU interpreter (programs one after
the other, tickets in program order) no program ever waits.

    x: [M, K]   W: [N, K] (a torch Linear weight)   y: [M, N] (written)   v: float32 [splits, M, R] (scratch)
    tiles: int32 [num_tiles, 4] (segment, first token, segment end, adapter), covering tokens first ..
           min(first + TILE_M, end) - 1; a padding tile (first == end, an adapter of rank 0) covers none

Columns: the call's modules side by side from column 0, each column block inside one module (block_n divides every
width). Each adapter's Aᵀ and Bᵀ rows are read once per tile (Bᵀ: per tile and column block).

Where it stands (H200, perf.bench_lora_gemm, perf/RESULTS.md sessions 15-16): the GEMM alone (gemm_launch) reads
the 7B projections 2-8% faster than cuBLAS at up to 16 rows, as fast at 64, and serves steps of up to 64 rows
(kernels/projection.py), where it also lets the LoRA shrink behind it start early (kernels/pdl.py). The LoRA
in one launch (lora_gemm_launch) was slower than cuBLAS + the separate LoRA launches on decode steps of few adapters
(64 decodes of 4 rank-64 adapters: 0.102 against 0.062 ms of LoRA a layer): each GEMM program walks its tiles one
after another, and the shrink programs take GEMM slots. The engine does not use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from slora.kernels.launch import cdiv, dot_precision, next_power_of_2
from slora.kernels.lora_shrink import MODULES, NUM_MODULES, fused_rows, split_dot, sum_split_partials, tile_bounds
from slora.kernels.metadata import LoraMeta, SegmentGroup
from slora.kernels.pdl import shrink_pdl
from slora.kernels.relaunch import Relaunch


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # rows per program at most (fewer rows: the next power of two, at least 16)
    block_n: int  # columns per program at most (less where a module's width needs it)
    block_k: int
    num_warps: int
    num_stages: int


def gemm_config(m: int, n: int, k: int) -> GemmConfig:
    """The config for x [m, k] · Wᵀ [k, n], from the H200 sweeps of perf.bench_lora_gemm (perf/RESULTS.md): at up to
    16 rows the fastest of its configs per 7B projection (2-8% ahead of cuBLAS); at up to 64 within 1-4% of
    cuBLAS (down 4% ahead); at 128 rows 15-32% behind cuBLAS."""
    if m <= 16:
        if n >= 16384:
            return GemmConfig(16, 64, 128, 4, 3)
        if k >= 8192:
            return GemmConfig(16, 32, 256, 4, 6)
        return GemmConfig(16, 32, 256 if n <= 8192 else 128, 4, 4)
    if m <= 64:
        if n >= 16384:
            return GemmConfig(64, 128, 64, 4, 4)
        if n <= 8192 or k >= 8192:
            return GemmConfig(64, 32, 256, 4, 4)
        return GemmConfig(64, 128, 128, 4, 4)
    return GemmConfig(128, 64, 128, 8, 4)


MAX_TILES = 16  # LoRA tiles a launch takes at most: every GEMM program runs each tile's step of its epilogue
TILE_M = 16  # tokens per LoRA tile (the graphs' static tiles of steps of few adapters have as many)
SHRINK_R = 32  # rank rows per shrink chunk
SHRINK_K = 128  # input features per shrink step
SHRINK_PROGRAMS = 128  # K is split until the shrink has about this many programs
MAX_SPLITS = 16
SYNC_SLOTS = 3 + MAX_TILES  # tickets, tiles done, GEMM programs done, then one arrival count per tile


@triton.jit(do_not_specialize=["M", "num_tiles", "splits", "k_per_split", "stride_v_split", "stride_v_tok"])
def _lora_gemm_kernel(
    x_ptr,  # [M, K], unit column stride
    stride_x,
    w_ptr,  # [N, K], unit column stride
    stride_w,
    bias_ptr,  # [N] (read when HAS_BIAS)
    y_ptr,  # [M, N], unit column stride (written)
    stride_y,
    M,
    K,
    n_blocks,  # column blocks: GEMM program p takes column block p % n_blocks, row block p // n_blocks
    v_ptr,  # float32 [splits, M, R]: the shrink's partial sums, their sum in split 0
    stride_v_split,
    stride_v_tok,
    sync_ptr,  # int32 [SYNC_SLOTS], zero between launches
    num_tiles,
    splits,
    k_per_split,  # input features per shrink split (a multiple of SHRINK_K)
    gemm_programs,
    tiles_ptr,
    ranks_ptr,  # int32 [num_adapters, 7]
    scales_ptr,  # float32 [num_adapters, 7]
    row_start_ptr,  # int32 [num_adapters, 7]
    a_rows_ptr,  # int64: flat pool offset of each lora_A row
    b_rows_ptr,  # int64: flat pool offset of each lora_Bᵀ row
    pool_ptr,  # one pool layer, flat
    width0,
    width1,
    FIRST_MODULE: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MAX_TILES_P2: tl.constexpr,  # a power of two >= num_tiles
    R_MAX: tl.constexpr,  # a power of two >= every rank of the call's modules (at least 16)
    TILE: tl.constexpr,
    S_R: tl.constexpr,
    S_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,  # let the LoRA shrink behind this GEMM start now (kernels/pdl.py)
):
    if USE_PDL:
        gdc_launch_dependents()
    if HAS_LORA:
        ticket = tl.atomic_add(sync_ptr, 1)
        shrink_programs = num_tiles * splits
        if ticket < shrink_programs:
            _shrink(
                ticket // splits, ticket % splits, x_ptr, stride_x, K, v_ptr, stride_v_split, stride_v_tok, sync_ptr,
                splits, k_per_split, tiles_ptr, ranks_ptr, row_start_ptr, a_rows_ptr, pool_ptr,
                FIRST_MODULE, NUM_SLICES, ROW_ALIGN, TILE, S_R, S_K, DOT_PRECISION,
            )  # fmt: skip
        else:
            _gemm(
                ticket - shrink_programs, x_ptr, stride_x, w_ptr, stride_w, bias_ptr, y_ptr, stride_y, M, K,
                n_blocks, v_ptr, stride_v_tok, sync_ptr, num_tiles, gemm_programs, tiles_ptr, ranks_ptr, scales_ptr,
                row_start_ptr, b_rows_ptr, pool_ptr, width0, width1, FIRST_MODULE, NUM_SLICES, ROW_ALIGN, HAS_BIAS,
                True, BLOCK_M, BLOCK_N, BLOCK_K, MAX_TILES_P2, R_MAX, TILE, DOT_PRECISION,
            )  # fmt: skip
    else:
        _gemm(
            tl.program_id(0), x_ptr, stride_x, w_ptr, stride_w, bias_ptr, y_ptr, stride_y, M, K,
            n_blocks, v_ptr, stride_v_tok, sync_ptr, num_tiles, gemm_programs, tiles_ptr, ranks_ptr, scales_ptr,
            row_start_ptr, b_rows_ptr, pool_ptr, width0, width1, FIRST_MODULE, NUM_SLICES, ROW_ALIGN, HAS_BIAS,
            False, BLOCK_M, BLOCK_N, BLOCK_K, MAX_TILES_P2, R_MAX, TILE, DOT_PRECISION,
        )  # fmt: skip


@triton.jit
def _shrink(
    tile, split, x_ptr, stride_x, K, v_ptr, stride_v_split, stride_v_tok, sync_ptr, splits, k_per_split, tiles_ptr,
    ranks_ptr, row_start_ptr, a_rows_ptr, pool_ptr,
    FIRST_MODULE: tl.constexpr, NUM_SLICES: tl.constexpr, ROW_ALIGN: tl.constexpr, TILE: tl.constexpr,
    S_R: tl.constexpr, S_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One shrink program: v[split] of the tile's tokens over its K split; the tile's last split sums the splits."""
    first, end, adapter = tile_bounds(tiles_ptr, tile)
    rank, row0 = fused_rows(ranks_ptr, row_start_ptr, adapter * MODULES + FIRST_MODULE, NUM_SLICES)
    tokens = first + tl.arange(0, TILE)
    tok_mask = tokens < tl.minimum(end, first + TILE)
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_x
    v_rows = v_ptr + tokens.to(tl.int64)[:, None] * stride_v_tok
    k_lo = split * k_per_split
    for c in range(0, rank, S_R):
        j = c + tl.arange(0, S_R)
        j_mask = j < rank
        rows = tl.multiple_of(tl.load(a_rows_ptr + row0 + j, mask=j_mask, other=0), ROW_ALIGN)
        acc = split_dot(x_rows, tok_mask, pool_ptr, rows, j_mask, k_lo, k_per_split, K, TILE, S_R, S_K, DOT_PRECISION)
        tl.store(v_rows + split * stride_v_split + j[None, :], acc, mask=tok_mask[:, None] & j_mask[None, :])
    tl.debug_barrier()  # every thread's partials stored before the arrival is counted (released by the atomic)
    if tl.atomic_add(sync_ptr + 3 + tile, 1, sem="acq_rel") == splits - 1:
        sum_split_partials(v_rows, stride_v_split, tok_mask, rank, splits, 0, S_R, S_R)  # the last split sums them
        tl.atomic_xchg(sync_ptr + 3 + tile, 0)
        tl.debug_barrier()
        tl.atomic_add(sync_ptr + 1, 1, sem="release")  # the tile is done


@triton.jit
def _gemm(
    pid, x_ptr, stride_x, w_ptr, stride_w, bias_ptr, y_ptr, stride_y, M, K, n_blocks, v_ptr, stride_v_tok, sync_ptr,
    num_tiles, gemm_programs, tiles_ptr, ranks_ptr, scales_ptr, row_start_ptr, b_rows_ptr, pool_ptr, width0, width1,
    FIRST_MODULE: tl.constexpr, NUM_SLICES: tl.constexpr, ROW_ALIGN: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MAX_TILES_P2: tl.constexpr, R_MAX: tl.constexpr, TILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One GEMM program: its block of x·Wᵀ (+ bias), then (HAS_LORA) every tile's v·Bᵀ·scale once v is complete."""
    n0 = (pid % n_blocks) * BLOCK_N
    row0 = (pid // n_blocks) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    n = n0 + tl.arange(0, BLOCK_N)
    if HAS_LORA:  # the tiles' metadata and Bᵀ row offsets: in flight during the K loop
        lora = _lora_tiles(
            n0, row0, tiles_ptr, num_tiles, ranks_ptr, scales_ptr, row_start_ptr, b_rows_ptr, width0, width1,
            FIRST_MODULE, NUM_SLICES, BLOCK_M, MAX_TILES_P2, R_MAX, TILE,
        )  # fmt: skip
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        xt = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        wt = tl.load(w_rows + k[None, :], mask=k_mask[None, :], other=0.0)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n).to(tl.float32)[None, :]
    if HAS_LORA:
        while tl.atomic_add(sync_ptr + 1, 0, sem="acquire") < num_tiles:
            pass  # the shrink programs hold earlier tickets: started, and waiting for nothing
        acc = _add_lora(acc, rows, lora, num_tiles, v_ptr, stride_v_tok, pool_ptr, ROW_ALIGN, BLOCK_N, MAX_TILES_P2,
                        R_MAX, DOT_PRECISION)  # fmt: skip
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_y + n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None])
    if HAS_LORA:
        if tl.atomic_add(sync_ptr + 2, 1, sem="acq_rel") == gemm_programs - 1:  # the last: counters back to zero
            tl.atomic_xchg(sync_ptr, 0)
            tl.atomic_xchg(sync_ptr + 1, 0)
            tl.atomic_xchg(sync_ptr + 2, 0)


@triton.jit
def _lora_tiles(
    n0, row0, tiles_ptr, num_tiles, ranks_ptr, scales_ptr, row_start_ptr, b_rows_ptr, width0, width1,
    FIRST_MODULE: tl.constexpr, NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, MAX_TILES_P2: tl.constexpr,
    R_MAX: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    """For each tile, as vectors: its first and end token, rank, scale and first column in v for the module of the
    program's columns (rank 0 for a tile with no token among the program's rows), and its Bᵀ rows' offsets
    [MAX_TILES_P2, R_MAX]; and the program's first column inside its module."""
    s = n0 * 0  # the module of the program's columns, and their first column inside it
    col = n0
    if NUM_SLICES > 1:
        s = tl.where(n0 >= width0, 1, 0)
        col = tl.where(n0 >= width0, n0 - width0, n0)
    if NUM_SLICES > 2:
        in_third = n0 >= width0 + width1
        s = tl.where(in_third, 2, s)
        col = tl.where(in_third, n0 - width0 - width1, col)
    t = tl.arange(0, MAX_TILES_P2)
    t_mask = t < num_tiles
    first = tl.load(tiles_ptr + 4 * t + 1, mask=t_mask, other=0)
    end = tl.minimum(tl.load(tiles_ptr + 4 * t + 2, mask=t_mask, other=0), first + TILE)
    table = tl.load(tiles_ptr + 4 * t + 3, mask=t_mask, other=0) * MODULES + FIRST_MODULE
    rank = tl.load(ranks_ptr + table + s, mask=t_mask, other=0)
    b_row0 = tl.load(row_start_ptr + table + s, mask=t_mask, other=0)
    scale = tl.load(scales_ptr + table + s, mask=t_mask, other=0.0)
    v_col = tl.zeros((MAX_TILES_P2,), dtype=tl.int32)  # the ranks of the call's modules before this one
    for before in tl.static_range(NUM_SLICES - 1):
        v_col += tl.where(before < s, tl.load(ranks_ptr + table + before, mask=t_mask, other=0), 0)
    live = t_mask & (first < end) & (first < row0 + BLOCK_M) & (end > row0)
    rank = tl.where(live, rank, 0)
    j = tl.arange(0, R_MAX)
    b_rows = tl.load(b_rows_ptr + b_row0[:, None] + j[None, :], mask=j[None, :] < rank[:, None], other=0)
    return first, end, rank, scale, v_col, b_rows, col


@triton.jit
def _add_lora(
    acc, rows, lora, num_tiles, v_ptr, stride_v_tok, pool_ptr, ROW_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr,
    MAX_TILES_P2: tl.constexpr, R_MAX: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """acc plus (v_t·Bᵀ)·scale of each token t of the program's rows that a tile covers, a tile at a time. v is read
    past L1: other SMs wrote it."""
    first, end, rank, scale, v_col, b_rows, col = lora
    t = tl.arange(0, MAX_TILES_P2)
    j = tl.arange(0, R_MAX)
    cols = col + tl.arange(0, BLOCK_N)
    v_rows = v_ptr + rows.to(tl.int64)[:, None] * stride_v_tok
    for g in tl.range(0, num_tiles, num_stages=2):
        sel = t == g
        j_mask = j < tl.sum(tl.where(sel, rank, 0))
        b_rows_g = tl.multiple_of(tl.sum(tl.where(sel[:, None], b_rows, 0), axis=0), ROW_ALIGN)
        bt = tl.load(pool_ptr + b_rows_g[:, None] + cols[None, :], mask=j_mask[:, None], other=0.0)
        tok = (rows >= tl.sum(tl.where(sel, first, 0))) & (rows < tl.sum(tl.where(sel, end, 0)))
        v_cols = tl.sum(tl.where(sel, v_col, 0)) + j[None, :]
        vt = tl.load(v_rows + v_cols, mask=tok[:, None] & j_mask[None, :], other=0.0, cache_modifier=".cg")
        part = tl.dot(vt.to(bt.dtype), bt, input_precision=DOT_PRECISION)
        acc += part * tl.sum(tl.where(sel, scale, 0.0))
    return acc


def gemm_launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    bias: torch.Tensor | None = None,
    cfg: GemmConfig | None = None,
    widths: tuple[int, ...] | None = None,
) -> Relaunch:
    """The launch of y = x·Wᵀ (+ bias), called as launch(x, weight, y) (launch(x, weight, y, bias) with a bias) for
    tensors shaped like these (every layer of a step); widths (default: one module of N columns) only limits the
    column block, as the LoRA launch does."""
    widths = widths or (weight.shape[0],)
    _check(x, weight, y, bias, widths)
    args, grid, options = _gemm_args(x, weight, y, bias, cfg, widths)
    args.update(
        v_ptr=x, stride_v_split=0, stride_v_tok=0, sync_ptr=x, num_tiles=0, splits=1, k_per_split=0,
        gemm_programs=grid, tiles_ptr=x, ranks_ptr=x, scales_ptr=x, row_start_ptr=x, a_rows_ptr=x, b_rows_ptr=x,
        pool_ptr=x, FIRST_MODULE=0, ROW_ALIGN=1, HAS_LORA=False, MAX_TILES_P2=2, R_MAX=16,
        USE_PDL=shrink_pdl(x.device),
    )  # fmt: skip
    changing = ("x_ptr", "w_ptr", "y_ptr") + (() if bias is None else ("bias_ptr",))
    return Relaunch(_lora_gemm_kernel, (grid,), args, options, changing=changing)


def lora_gemm_launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    flat_layer: torch.Tensor,
    meta: LoraMeta,
    first_module: int,
    widths: tuple[int, ...],
    group: SegmentGroup | None = None,
    bias: torch.Tensor | None = None,
    cfg: GemmConfig | None = None,
) -> Relaunch:
    """The launch of y = x·Wᵀ (+ bias) plus the LoRA of modules first_module .. + len(widths) - 1 (see top), called
    as launch(x, weight, y, flat_layer) (then bias, with one) for tensors shaped like these (every layer of a
    step). Its scratch (v and the counters) belongs to the launch: launches run one after the other on a stream,
    never two at once."""
    _check(x, weight, y, bias, widths)
    _check_lora(weight, meta, first_module, widths)
    group = meta.whole() if group is None else group
    if group.static is not None and group.static.tile_block != TILE_M:
        raise ValueError(f"the fused LoRA needs {TILE_M}-token tiles, the graph's are {group.static.tile_block}")
    tiles = group.tiles(TILE_M)
    num_tiles = int(tiles.shape[0])
    if num_tiles > MAX_TILES:
        raise ValueError(f"the fused LoRA takes at most {MAX_TILES} tiles of {TILE_M} tokens, the step has {num_tiles}")
    k = int(x.shape[1])
    k_blocks = cdiv(k, SHRINK_K)
    wanted = max(1, min(k_blocks, MAX_SPLITS, SHRINK_PROGRAMS // max(num_tiles, 1)))
    k_per_split = cdiv(k_blocks, 1 << (wanted.bit_length() - 1)) * SHRINK_K
    splits = cdiv(k, k_per_split)
    fused_rank = meta.fused_rank(first_module, len(widths))
    v = torch.empty((splits, x.shape[0], max(fused_rank, 1)), dtype=torch.float32, device=x.device)
    sync = torch.zeros(SYNC_SLOTS, dtype=torch.int32, device=x.device)
    args, gemm_programs, options = _gemm_args(x, weight, y, bias, cfg, widths)
    args.update(
        v_ptr=v, stride_v_split=v.stride(0), stride_v_tok=v.stride(1), sync_ptr=sync, num_tiles=num_tiles,
        splits=splits, k_per_split=k_per_split, gemm_programs=gemm_programs, tiles_ptr=tiles, ranks_ptr=meta.ranks,
        scales_ptr=meta.scales, row_start_ptr=meta.row_start, a_rows_ptr=meta.a_rows, b_rows_ptr=meta.b_rows,
        pool_ptr=flat_layer, FIRST_MODULE=first_module, ROW_ALIGN=meta.row_align, HAS_LORA=True,
        MAX_TILES_P2=next_power_of_2(max(num_tiles, 2)),
        R_MAX=max(16, next_power_of_2(max_module_rank(meta, first_module, len(widths)))), USE_PDL=False,
    )  # fmt: skip
    grid = (num_tiles * splits + gemm_programs,)
    changing = ("x_ptr", "w_ptr", "y_ptr", "pool_ptr") + (() if bias is None else ("bias_ptr",))
    return Relaunch(_lora_gemm_kernel, grid, args, options, changing=changing)


def _gemm_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    bias: torch.Tensor | None,
    cfg: GemmConfig | None,
    widths: tuple[int, ...],
) -> tuple[dict[str, object], int, dict[str, object]]:
    """The GEMM's arguments, its number of programs and the launch options."""
    m, k = x.shape
    n = weight.shape[0]
    cfg = cfg or gemm_config(m, n, k)
    block_m = min(cfg.block_m, max(16, next_power_of_2(m)))
    block_n = column_block(cfg.block_n, widths)
    n_blocks = cdiv(n, block_n)
    args: dict[str, object] = dict(
        x_ptr=x, stride_x=x.stride(0), w_ptr=weight, stride_w=weight.stride(0),
        bias_ptr=weight if bias is None else bias, y_ptr=y, stride_y=y.stride(0), M=m, K=k, n_blocks=n_blocks,
        width0=widths[0], width1=widths[1] if len(widths) > 1 else 0, NUM_SLICES=len(widths),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k, TILE=TILE_M,
        S_R=SHRINK_R, S_K=SHRINK_K, DOT_PRECISION=dot_precision(x.dtype),
    )  # fmt: skip
    return args, n_blocks * cdiv(m, block_m), dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def max_module_rank(meta: LoraMeta, first_module: int, num_modules: int) -> int:
    """The largest rank of modules first_module .. + num_modules - 1 over the step's adapters (a graph's: its bound)."""
    if meta.static is not None:
        return meta.static.max_rank
    return max((max(r[first_module : first_module + num_modules]) for r in meta.ranks_host), default=0)


def column_block(block_n: int, widths: tuple[int, ...]) -> int:
    """The widest power of two up to block_n that divides every module's width: no column block straddles two
    modules (at least 16, which every projection width of the models served here is a multiple of)."""
    common = math.gcd(*widths)
    return max(16, min(block_n, common & -common))


def _check(
    x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, widths: tuple[int, ...]
) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} are not [M, K] and [N, K]")
    if x.stride(1) != 1 or weight.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("x, weight and y need a unit column stride")
    if tuple(y.shape) != (x.shape[0], weight.shape[0]) or y.dtype != x.dtype or weight.dtype != x.dtype:
        raise ValueError(f"y must be {x.dtype} [{x.shape[0]}, {weight.shape[0]}], got {y.dtype} {tuple(y.shape)}")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{weight.shape[0]}], got {tuple(bias.shape)}")
    if sum(widths) != weight.shape[0] or not 1 <= len(widths) <= 3:
        raise ValueError(f"1 to 3 module widths summing to {weight.shape[0]} expected, got {widths}")
    if any(w % 16 for w in widths):
        raise ValueError(f"module widths must be multiples of 16, got {widths}")


def _check_lora(weight: torch.Tensor, meta: LoraMeta, first_module: int, widths: tuple[int, ...]) -> None:
    if first_module < 0 or first_module + len(widths) > NUM_MODULES:
        raise ValueError(f"modules {first_module}..{first_module + len(widths) - 1} are not LoRA modules")
    if meta.ranks.device != weight.device:
        raise ValueError("the LoRA metadata must be on the weight's device")
