"""A projection and its LoRA expand in one launch: y = x·Wᵀ (+ bias) + (v_t·Bᵀ_t)·scale_t for each token t.

A decode step's LoRA call site costs a base GEMM, a shrink and an expand: three launches, each a few microseconds
of fixed cost in a CUDA graph, which is most of the LoRA's time when few adapters share the step (a layer's four
call sites cost ~25 µs however little they read, perf/RESULTS.md session 13). Here the expand runs in the GEMM's
epilogue: a program that has summed its BLOCK_N columns of x·Wᵀ over K adds, for every LoRA tile that overlaps
its rows, that tile's v·Bᵀ over the same columns, and stores y once. Launched with PDL behind the shrink, the
GEMM's K loop (which does not read v) runs while the shrink does; only the epilogue waits for v.

    x: [M, K]            W: [N, K] (a torch Linear weight)      y: [M, N] (written)
    v: [split_k, M, R] float32, the shrink's output (lora_shrink.py) for the modules of the call: K-split partial
       sums from the GEMV shrink, summed here; one split (their sum) from the tensor-core shrink
    tiles: int32 [num_tiles, 4] (segment, first token, segment end, adapter): a tile covers tokens
           first .. min(first + tile_block, end) - 1; a padding tile (first == end) covers none

Columns: the call's modules side by side from column 0 (widths width0, width1, width2), each column block inside
one module (block_n divides every width). Each adapter's Bᵀ rows are read once per tile and column block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from slora.kernels.launch import cdiv, dot_precision, next_power_of_2
from slora.kernels.lora_shrink import MODULES, NUM_MODULES
from slora.kernels.metadata import LoraMeta, SegmentGroup
from slora.kernels.pdl import pdl_enabled
from slora.kernels.relaunch import Relaunch


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # rows per program at most (fewer rows: the next power of two, at least 16)
    block_n: int  # columns per program at most (less where a module's width needs it)
    block_k: int
    num_warps: int
    num_stages: int


DECODE = GemmConfig(128, 64, 128, 4, 4)


def gemm_config(m: int, n: int, k: int) -> GemmConfig:
    """The config for x [m, k] · Wᵀ [k, n], from the H200 sweeps of perf.bench_lora_gemm (perf/RESULTS.md): at up to
    16 rows the fastest of its configs per 7B projection (2-8% ahead of cuBLAS); at up to 64 within 1-4% of
    cuBLAS (down 4% ahead); more rows: none came within 20% of cuBLAS."""
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


MAX_TILES = 16  # LoRA tiles a launch takes at most: the epilogue runs every tile's step in every program


@triton.jit(do_not_specialize=["M", "num_tiles", "tile_block", "split_k", "stride_v_split", "stride_v_tok"])
def _gemm_lora_kernel(
    x_ptr,  # [M, K], unit column stride
    stride_x,
    w_ptr,  # [N, K], unit column stride
    stride_w,
    bias_ptr,  # [N] (read when HAS_BIAS)
    y_ptr,  # [M, N], unit column stride (written)
    stride_y,
    M,
    K,
    v_ptr,  # float32 [split_k, M, R]
    stride_v_split,
    stride_v_tok,
    split_k,
    tiles_ptr,
    num_tiles,
    tile_block,
    ranks_ptr,  # int32 [num_adapters, 7]
    scales_ptr,  # float32 [num_adapters, 7]
    row_start_ptr,  # int32 [num_adapters, 7]
    b_rows_ptr,  # int64: flat pool offset of each lora_Bᵀ row
    pool_ptr,  # one pool layer, flat
    width0,
    width1,
    FIRST_MODULE: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with PDL behind the shrink: wait for its v before the epilogue
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MAX_TILES: tl.constexpr,  # a power of two >= num_tiles
    R_MAX: tl.constexpr,  # a power of two >= every rank of the call's modules (at least 16)
    EPILOGUE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    n0 = tl.program_id(0) * BLOCK_N
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    n = n0 + tl.arange(0, BLOCK_N)
    if HAS_LORA:  # the LoRA tiles' metadata and Bᵀ row offsets: loaded now, in flight during the K loop
        lora = _lora_tiles(
            n0, tiles_ptr, num_tiles, tile_block, ranks_ptr, scales_ptr, row_start_ptr, b_rows_ptr, width0, width1,
            FIRST_MODULE, NUM_SLICES, BLOCK_M, MAX_TILES, R_MAX,
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
        if USE_PDL:
            gdc_wait()  # the shrink's v from here on
        if EPILOGUE == 0:
            acc = _add_lora(
                acc, rows, lora, v_ptr, stride_v_split, stride_v_tok, split_k, pool_ptr,
                ROW_ALIGN, BLOCK_N, MAX_TILES, R_MAX, DOT_PRECISION,
            )  # fmt: skip
        else:
            acc = _add_lora_loop(
                acc, rows, lora, num_tiles, v_ptr, stride_v_split, stride_v_tok, split_k, pool_ptr,
                ROW_ALIGN, BLOCK_N, MAX_TILES, R_MAX, DOT_PRECISION,
            )  # fmt: skip
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_y + n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None])


@triton.jit
def _lora_tiles(
    n0, tiles_ptr, num_tiles, tile_block, ranks_ptr, scales_ptr, row_start_ptr, b_rows_ptr, width0, width1,
    FIRST_MODULE: tl.constexpr, NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, MAX_TILES: tl.constexpr,
    R_MAX: tl.constexpr,
):  # fmt: skip
    """For each of the (up to MAX_TILES) tiles, as vectors: its first and end token, rank, scale and first column in
    v for the module of the program's columns, whether it adds anything to the program's rows, and its Bᵀ rows'
    offsets [MAX_TILES, R_MAX] (beyond the rank: 0); and the program's first column inside its module."""
    s = n0 * 0  # the module of the program's columns, and their first column inside it
    col = n0
    if NUM_SLICES > 1:
        s = tl.where(n0 >= width0, 1, 0)
        col = tl.where(n0 >= width0, n0 - width0, n0)
    if NUM_SLICES > 2:
        in_third = n0 >= width0 + width1
        s = tl.where(in_third, 2, s)
        col = tl.where(in_third, n0 - width0 - width1, col)
    t = tl.arange(0, MAX_TILES)
    t_mask = t < num_tiles
    first = tl.load(tiles_ptr + 4 * t + 1, mask=t_mask, other=0)
    end = tl.minimum(tl.load(tiles_ptr + 4 * t + 2, mask=t_mask, other=0), first + tile_block)
    table = tl.load(tiles_ptr + 4 * t + 3, mask=t_mask, other=0) * MODULES + FIRST_MODULE
    rank = tl.load(ranks_ptr + table + s, mask=t_mask, other=0)
    row0 = tl.load(row_start_ptr + table + s, mask=t_mask, other=0)
    scale = tl.load(scales_ptr + table + s, mask=t_mask, other=0.0)
    v_col = tl.zeros((MAX_TILES,), dtype=tl.int32)  # the ranks of the call's modules before this one
    for before in tl.static_range(NUM_SLICES - 1):
        v_col += tl.where(before < s, tl.load(ranks_ptr + table + before, mask=t_mask, other=0), 0)
    row_lo = tl.program_id(1) * BLOCK_M
    live = t_mask & (first < end) & (first < row_lo + BLOCK_M) & (end > row_lo) & (rank > 0)
    rank = tl.where(live, rank, 0)
    j = tl.arange(0, R_MAX)
    b_rows = tl.load(b_rows_ptr + row0[:, None] + j[None, :], mask=j[None, :] < rank[:, None], other=0)
    return first, end, rank, scale, v_col, b_rows, col


@triton.jit
def _add_lora(
    acc, rows, lora, v_ptr, stride_v_split, stride_v_tok, split_k, pool_ptr,
    ROW_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr, MAX_TILES: tl.constexpr, R_MAX: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """acc plus (v_t·Bᵀ)·scale of each token t of the program's rows that a tile covers. Every tile is one masked
    step (no branch), so that their Bᵀ loads can all be in flight together."""
    first, end, rank, scale, v_col, b_rows, col = lora
    t = tl.arange(0, MAX_TILES)
    j = tl.arange(0, R_MAX)
    cols = col + tl.arange(0, BLOCK_N)
    lo = rows.to(tl.int64)[:, None] * stride_v_tok
    for g in tl.static_range(MAX_TILES):
        sel = t == g
        rank_g = tl.sum(tl.where(sel, rank, 0))
        j_mask = j < rank_g
        rows_g = tl.multiple_of(tl.sum(tl.where(sel[:, None], b_rows, 0), axis=0), ROW_ALIGN)
        bt = tl.load(pool_ptr + rows_g[:, None] + cols[None, :], mask=j_mask[:, None], other=0.0)
        tok = (rows >= tl.sum(tl.where(sel, first, 0))) & (rows < tl.sum(tl.where(sel, end, 0)))
        v_mask = tok[:, None] & j_mask[None, :]
        v_cols = lo + tl.sum(tl.where(sel, v_col, 0)) + j[None, :]
        vt = tl.load(v_ptr + v_cols, mask=v_mask, other=0.0)
        for sp in range(1, split_k):  # the GEMV shrink's K splits: their partial sums, in split order
            vt += tl.load(v_ptr + sp * stride_v_split + v_cols, mask=v_mask, other=0.0)
        part = tl.dot(vt.to(bt.dtype), bt, input_precision=DOT_PRECISION)
        acc += part * tl.sum(tl.where(sel, scale, 0.0))
    return acc


@triton.jit
def _add_lora_loop(
    acc, rows, lora, num_tiles, v_ptr, stride_v_split, stride_v_tok, split_k, pool_ptr,
    ROW_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr, MAX_TILES: tl.constexpr, R_MAX: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """_add_lora as a loop over the tiles (one tile's Bᵀ in registers at a time)."""
    first, end, rank, scale, v_col, b_rows, col = lora
    t = tl.arange(0, MAX_TILES)
    j = tl.arange(0, R_MAX)
    cols = col + tl.arange(0, BLOCK_N)
    lo = rows.to(tl.int64)[:, None] * stride_v_tok
    for g in range(0, num_tiles):
        sel = t == g
        rank_g = tl.sum(tl.where(sel, rank, 0))
        j_mask = j < rank_g
        rows_g = tl.multiple_of(tl.sum(tl.where(sel[:, None], b_rows, 0), axis=0), ROW_ALIGN)
        bt = tl.load(pool_ptr + rows_g[:, None] + cols[None, :], mask=j_mask[:, None], other=0.0)
        tok = (rows >= tl.sum(tl.where(sel, first, 0))) & (rows < tl.sum(tl.where(sel, end, 0)))
        v_mask = tok[:, None] & j_mask[None, :]
        v_cols = lo + tl.sum(tl.where(sel, v_col, 0)) + j[None, :]
        vt = tl.load(v_ptr + v_cols, mask=v_mask, other=0.0)
        for sp in range(1, split_k):
            vt += tl.load(v_ptr + sp * stride_v_split + v_cols, mask=v_mask, other=0.0)
        part = tl.dot(vt.to(bt.dtype), bt, input_precision=DOT_PRECISION)
        acc += part * tl.sum(tl.where(sel, scale, 0.0))
    return acc


EPILOGUE = 0  # 0: every tile unrolled and masked; 1: a loop over the tiles


def gemm_launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    bias: torch.Tensor | None = None,
    cfg: GemmConfig = DECODE,
    widths: tuple[int, ...] | None = None,
) -> Relaunch:
    """The launch of y = x·Wᵀ (+ bias), called as launch(x, weight, y) for tensors shaped like these (every layer of
    a step); widths (default: one module of N columns) only limits the column block, as the LoRA launch does."""
    return _launch(x, weight, y, bias, cfg, widths or (weight.shape[0],), lora=None)


def gemm_lora_launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    v: torch.Tensor,
    flat_layer: torch.Tensor,
    meta: LoraMeta,
    first_module: int,
    widths: tuple[int, ...],
    group: SegmentGroup | None = None,
    bias: torch.Tensor | None = None,
    cfg: GemmConfig = DECODE,
) -> Relaunch:
    """The launch of y = x·Wᵀ (+ bias) plus the LoRA of modules first_module .. + len(widths) - 1 read from v
    (lora_shrink.shrink_launch's, on the same group), called as launch(x, weight, y,
    flat_layer) for tensors shaped like these (every layer of a step)."""
    _check_lora(weight, v, y, meta, first_module, widths)
    group = meta.whole() if group is None else group
    block = group.static.tile_block if group.static is not None else max(group.max_segment_len, 1)
    tiles = group.tiles(block)
    num_tiles = int(tiles.shape[0])
    if num_tiles > MAX_TILES:
        raise ValueError(f"the fused LoRA epilogue takes at most {MAX_TILES} tiles, the step has {num_tiles}")
    lora = dict(
        v_ptr=v, stride_v_split=v.stride(0), stride_v_tok=v.stride(1), split_k=int(v.shape[0]),
        tiles_ptr=tiles, num_tiles=num_tiles, tile_block=block,
        ranks_ptr=meta.ranks, scales_ptr=meta.scales, row_start_ptr=meta.row_start, b_rows_ptr=meta.b_rows,
        pool_ptr=flat_layer, FIRST_MODULE=first_module, ROW_ALIGN=meta.row_align,
        MAX_TILES=next_power_of_2(max(num_tiles, 2)),
        R_MAX=max(16, next_power_of_2(rank_bound(meta, first_module, len(widths)))),
    )  # fmt: skip
    return _launch(x, weight, y, bias, cfg, widths, lora)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    bias: torch.Tensor | None,
    cfg: GemmConfig,
    widths: tuple[int, ...],
    lora: dict[str, object] | None,
) -> Relaunch:
    _check(x, weight, y, bias, widths)
    m, k = x.shape
    block_m = min(cfg.block_m, max(16, next_power_of_2(m)))
    block_n = column_block(cfg.block_n, widths)
    use_pdl = lora is not None and pdl_enabled(x.device)
    args: dict[str, object] = dict(
        x_ptr=x, stride_x=x.stride(0), w_ptr=weight, stride_w=weight.stride(0),
        bias_ptr=weight if bias is None else bias, y_ptr=y, stride_y=y.stride(0), M=m, K=k,
        v_ptr=x, stride_v_split=0, stride_v_tok=0, split_k=1, tiles_ptr=x, num_tiles=0, tile_block=1,
        ranks_ptr=x, scales_ptr=x, row_start_ptr=x, b_rows_ptr=x, pool_ptr=x,
        width0=widths[0], width1=widths[1] if len(widths) > 1 else 0,
        FIRST_MODULE=0, NUM_SLICES=len(widths), ROW_ALIGN=1, HAS_BIAS=bias is not None, HAS_LORA=lora is not None,
        USE_PDL=use_pdl, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k, MAX_TILES=2, R_MAX=16,
        EPILOGUE=EPILOGUE,
        DOT_PRECISION=dot_precision(x.dtype),
    )  # fmt: skip
    args.update(lora or {})
    options: dict[str, object] = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if use_pdl:
        options.update(launch_pdl=True)
    grid = (cdiv(weight.shape[0], block_n), cdiv(m, block_m))
    changing = ("x_ptr", "w_ptr", "y_ptr") + (("pool_ptr",) if lora is not None else ())
    return Relaunch(_gemm_lora_kernel, grid, args, options, changing=changing)


def rank_bound(meta: LoraMeta, first_module: int, num_modules: int) -> int:
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


def _check_lora(
    weight: torch.Tensor, v: torch.Tensor, y: torch.Tensor, meta: LoraMeta, first_module: int, widths: tuple[int, ...]
) -> None:
    if first_module < 0 or first_module + len(widths) > NUM_MODULES:
        raise ValueError(f"modules {first_module}..{first_module + len(widths) - 1} are not LoRA modules")
    if v.dtype != torch.float32 or v.dim() != 3 or v.shape[1] != y.shape[0] or v.stride(2) != 1:
        raise ValueError(f"v must be the shrink's float32 [splits, {y.shape[0]}, R], got {v.dtype} {tuple(v.shape)}")
    if meta.ranks.device != weight.device:
        raise ValueError("the LoRA metadata must be on the weight's device")
