"""LoRA expand over the unified pool: y[:, offset_m : offset_m + out_m] += (v_m · Bᵀ_m) * scale_m, per token.

The second half of the shrink kernel's work (see lora_shrink.py): v holds split-K partial sums of x·Aᵀ for the
fused modules of one call (one split, their sum, from the tensor-core shrink). One program takes one tile of
up to BLOCK_M tokens of one segment (one adapter) and one BLOCK_N slice of the output columns of one module of the
call. Grid axis 1 runs over every module's column blocks, so the modules run side by side, and a narrow module
(GQA's k and v) gets programs for its own columns only, none that would find nothing to add. A program sums the
partials (GEMV), reads the adapter's Bᵀ rows for those columns once for all tokens of the tile, and adds the scaled
product into y
(read-modify-write, each element of y owned by one program, so no atomics).

    v:  [split_k, num_tokens, R] float32      pool layer (flat): rows of lora_Bᵀ, out_m elements each
    y:  [num_tokens, ≥ Σ out_m]                written only in the rows of adapter tokens and the modules they target

Steps of decodes only go to a GEMV kernel (same arguments; see ExpandConfig.gemv). Rank chunks stop at each
adapter's own rank; modules an adapter does not target (rank 0) cost nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from slora.kernels.metadata import SHORT_SEGMENT, LoraMeta, SegmentGroup
from slora.kernels.settings import DEFAULT_SETTINGS, KernelSettings
from slora.kernels.triton.launch import cdiv, dot_precision, next_power_of_2
from slora.kernels.triton.lora_shrink import MODULES, NUM_MODULES, tile_bounds
from slora.kernels.triton.pdl import pdl_enabled
from slora.kernels.triton.relaunch import Relaunch


@dataclass(frozen=True)
class ExpandConfig:
    block_m: int  # tokens per tile (the shrink kernel's tiles need not match)
    block_r: int  # rank rows per chunk
    block_n: tuple[int, ...]  # output columns per program: the widest that still gives target_programs
    target_programs: int
    num_warps: int
    num_stages: int
    # The GEMV kernel: one program per (tile, column block, module), one token at a time on CUDA cores (see
    # ShrinkConfig.gemv).
    gemv: bool = False
    # Column blocks one program of the tensor-core kernel adds, one after the other: its tile's table, ranks and
    # row offsets are loaded once for all of them, and a step of many one-token tiles makes fewer, longer programs.
    n_chunks: int = 1
    # The tensor-core kernel reads its first Bᵀ chunk before it waits for the shrink (launched with PDL), as the
    # GEMV kernel always does, so that the read overlaps the shrink's end; off: it reads everything after the wait.
    prefetch: bool = False

    def __post_init__(self) -> None:
        if self.n_chunks < 1 or (self.gemv and self.n_chunks != 1):
            raise ValueError(f"n_chunks must be >= 1 (1 for the GEMV kernel), got {self.n_chunks}")
        if self.gemv and self.prefetch:
            raise ValueError("prefetch is the tensor-core kernel's option (the GEMV kernel always reads Bᵀ first)")


DECODE = ExpandConfig(1, 16, (1024,), 1024, 4, 2, gemv=True)  # picked as the shrink's (shrink_config)
# Calls of one module (o, down): 32-row rank chunks in 512-column blocks, 2 warps, ahead of DECODE on mixed ranks in
# the H200 sweep (perf/RESULTS.md). The fused calls keep 16-row chunks: a wider chunk takes more registers, so fewer
# programs are resident.
DECODE_ONE = ExpandConfig(1, 32, (512,), 1024, 2, 2, gemv=True)
MIXED = ExpandConfig(16, 16, (256,), 512, 4, 2)  # one width: no variant compiled for a new tile count
PREFILL = ExpandConfig(64, 16, (128,), 512, 4, 2)


def expand_config(group: SegmentGroup, num_slices: int, settings: KernelSettings = DEFAULT_SETTINGS) -> ExpandConfig:
    """The config of a call of num_slices fused modules, picked as the shrink's (shrink_config)."""
    kind = group.kind(settings)
    if kind in ("decode", "short"):
        cfg = DECODE_ONE if num_slices == 1 else DECODE
        return cfg if kind == "decode" else dataclasses.replace(cfg, block_m=SHORT_SEGMENT)
    return MIXED if kind == "mixed" else PREFILL


@triton.jit(do_not_specialize=["stride_v_tok"])  # as the shrink: rank-dependent
def _lora_expand_kernel(
    v_ptr,  # float32 [1, num_tokens, R]: the tensor-core shrink's sums
    stride_v_tok,
    pool_ptr,  # one pool layer, flat: Bᵀ rows live at the offsets in b_rows
    y_ptr,  # [num_tokens, ≥ Σ out_m], unit column stride (updated in place)
    stride_y,
    tiles_ptr,  # int32 [num_tiles, 4]: (segment, first token, segment end, adapter)
    ranks_ptr,  # int32 [num_adapters, 7]
    scales_ptr,  # float32 [num_adapters, 7]
    row_start_ptr,  # int32 [num_adapters, 7]
    b_rows_ptr,  # int64 [total_rows]: flat pool offset of each lora_Bᵀ row
    offset0,  # first column in y of each fused module's output, and its width
    offset1,
    offset2,
    width0,
    width1,
    width2,
    blocks1,  # grid axis 1's first program of module 1, and of module 2 (column_blocks)
    blocks2,
    FIRST_MODULE: tl.constexpr,
    NUM_SLICES: tl.constexpr,  # 1 to 3 consecutive modules
    ROW_ALIGN: tl.constexpr,  # every Bᵀ row offset is a multiple of this
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_CHUNKS: tl.constexpr,  # column blocks per program, one after the other (ExpandConfig.n_chunks)
    USE_PDL: tl.constexpr,  # launched with PDL behind the shrink: wait for its v (kernels/triton/pdl.py)
    DOT_PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr,  # the first Bᵀ chunk read before the wait (ExpandConfig.prefetch)
):
    s, block = module_block(blocks1, blocks2)
    n_start = block * (BLOCK_N * N_CHUNKS)
    first, end, adapter = tile_bounds(tiles_ptr, tl.program_id(0))
    rank, row0, scale, offset, width, v_col = module_of_program(
        ranks_ptr, scales_ptr, row_start_ptr, adapter * MODULES + FIRST_MODULE, s,
        offset0, offset1, offset2, width0, width1, width2, NUM_SLICES,
    )  # fmt: skip
    if PREFETCH:  # Bᵀ is the pool's, which the shrink does not write; masked off where the program adds nothing
        bt_first = load_bt(pool_ptr, b_rows_ptr, row0, rank, 0, n_start, width, ROW_ALIGN, BLOCK_R, BLOCK_N)
    if USE_PDL:
        gdc_wait()
    if (rank > 0) & (n_start < width):
        tokens = first + tl.arange(0, BLOCK_M)
        tok_mask = tokens < end
        v_rows = v_ptr + tokens.to(tl.int64)[:, None] * stride_v_tok + v_col
        y_rows = y_ptr + tokens.to(tl.int64)[:, None] * stride_y + offset
        for n0 in range(n_start, tl.minimum(width, n_start + BLOCK_N * N_CHUNKS), BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < width
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for c in range(0, rank, BLOCK_R):
                j = c + tl.arange(0, BLOCK_R)
                j_mask = j < rank
                vt = tl.load(v_rows + j[None, :], mask=tok_mask[:, None] & j_mask[None, :], other=0.0)
                if PREFETCH:
                    if (c == 0) & (n0 == n_start):
                        bt = bt_first
                    else:
                        bt = load_bt(pool_ptr, b_rows_ptr, row0, rank, c, n0, width, ROW_ALIGN, BLOCK_R, BLOCK_N)
                else:
                    bt = load_bt(pool_ptr, b_rows_ptr, row0, rank, c, n0, width, ROW_ALIGN, BLOCK_R, BLOCK_N)
                acc = tl.dot(vt.to(bt.dtype), bt, acc, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
            y_mask = tok_mask[:, None] & n_mask[None, :]
            yt = tl.load(y_rows + n[None, :], mask=y_mask, other=0.0)
            tl.store(y_rows + n[None, :], (yt.to(tl.float32) + acc * scale).to(yt.dtype), mask=y_mask)


@triton.jit
def load_bt(pool_ptr, b_rows_ptr, row0, rank, c, n0, width, ROW_ALIGN: tl.constexpr, BLOCK_R: tl.constexpr,
            BLOCK_N: tl.constexpr):  # fmt: skip
    """Bᵀ rows c .. c + BLOCK_R - 1 (those below `rank`) of columns n0 .. n0 + BLOCK_N - 1 (those below `width`)."""
    j = c + tl.arange(0, BLOCK_R)
    j_mask = j < rank
    n = n0 + tl.arange(0, BLOCK_N)
    rows = tl.load(b_rows_ptr + row0 + j, mask=j_mask, other=0)
    rows = tl.multiple_of(rows, ROW_ALIGN)
    return tl.load(pool_ptr + rows[:, None] + n[None, :], mask=j_mask[:, None] & (n < width)[None, :], other=0.0)


@triton.jit
def module_block(blocks1, blocks2):
    """(module of the call, column block within it) of this program's index on grid axis 1, which lists module 0's
    column blocks, then module 1's from blocks1, then module 2's from blocks2."""
    b = tl.program_id(1)
    s = tl.where(b < blocks1, 0, tl.where(b < blocks2, 1, 2))
    return s, b - tl.where(s == 0, 0, tl.where(s == 1, blocks1, blocks2))


@triton.jit
def module_of_program(
    ranks_ptr, scales_ptr, row_start_ptr, table, s, offset0, offset1, offset2, width0, width1, width2,
    NUM_SLICES: tl.constexpr,
):  # fmt: skip
    """(rank, first Bᵀ row-table entry, scale, first column in y, width, first column in v) of the call's module s,
    for the adapter whose table row (adapter * 7 + first module) is `table`. The loads depend only on the adapter,
    so they go out together."""
    rank = tl.load(ranks_ptr + table + s)
    row0 = tl.load(row_start_ptr + table + s)
    scale = tl.load(scales_ptr + table + s)
    offset = tl.where(s == 0, offset0, tl.where(s == 1, offset1, offset2))
    width = tl.where(s == 0, width0, tl.where(s == 1, width1, width2))
    v_col = 0  # the module's first column in v: the ranks of the call's modules before it
    for before in tl.static_range(NUM_SLICES - 1):
        v_col += tl.where(before < s, tl.load(ranks_ptr + table + before), 0)
    return rank, row0, scale, offset, width, v_col


@triton.jit(do_not_specialize=["split_k", "stride_v_split", "stride_v_tok"])
def _lora_expand_gemv_kernel(
    v_ptr,
    stride_v_split,
    stride_v_tok,
    split_k,
    pool_ptr,
    y_ptr,
    stride_y,
    tiles_ptr,
    ranks_ptr,
    scales_ptr,
    row_start_ptr,
    b_rows_ptr,
    offset0,
    offset1,
    offset2,
    width0,
    width1,
    width2,
    blocks1,
    blocks2,
    FIRST_MODULE: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,  # a power of two ≥ split_k
    USE_PDL: tl.constexpr,
):
    """The dot kernel's work (same arguments), one token at a time:
    y_t += (Σ_j v_t[j] · Bᵀ[j, :]) · scale in float32. The tile's later tokens read Bᵀ again, from cache.

    Each rank chunk of Bᵀ is read before the chunk's v: launched with PDL, the first chunk's read overlaps the
    shrink (kernels/triton/pdl.py)."""
    s, block = module_block(blocks1, blocks2)
    n0 = block * BLOCK_N
    first, end, adapter = tile_bounds(tiles_ptr, tl.program_id(0))
    rank, row0, scale, offset, width, v_col = module_of_program(
        ranks_ptr, scales_ptr, row_start_ptr, adapter * MODULES + FIRST_MODULE, s,
        offset0, offset1, offset2, width0, width1, width2, NUM_SLICES,
    )  # fmt: skip
    if (rank > 0) & (n0 < width):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < width
        sp = tl.arange(0, SPLITS)
        for i in range(0, tl.minimum(end - first, BLOCK_M)):  # the tile's tokens (rows first + i)
            t = first.to(tl.int64) + i
            y_row = y_ptr + t * stride_y + offset
            v_row = v_ptr + t * stride_v_tok + v_col
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for c in range(0, rank, BLOCK_R):
                j = c + tl.arange(0, BLOCK_R)
                j_mask = j < rank
                rows = tl.load(b_rows_ptr + row0 + j, mask=j_mask, other=0)
                rows = tl.multiple_of(rows, ROW_ALIGN)
                bt = tl.load(pool_ptr + rows[:, None] + n[None, :], mask=j_mask[:, None] & n_mask[None, :], other=0.0)
                if USE_PDL:
                    gdc_wait()  # the shrink's v from here on (a no-op once the shrink has ended)
                # every split's partial sums at once: [SPLITS, BLOCK_R], summed over the splits
                v_ptrs = v_row + sp[:, None].to(tl.int64) * stride_v_split + j[None, :]
                vt = tl.sum(tl.load(v_ptrs, mask=(sp[:, None] < split_k) & j_mask[None, :], other=0.0), axis=0)
                acc += tl.sum(vt[:, None] * bt.to(tl.float32), axis=0)
            yt = tl.load(y_row + n, mask=n_mask, other=0.0)  # after the wait: the projection writes y
            tl.store(y_row + n, (yt.to(tl.float32) + acc * scale).to(yt.dtype), mask=n_mask)
    if USE_PDL:
        gdc_wait()  # also a program with nothing to add: the expand must not end before the shrink


def expand_launch(
    y: torch.Tensor,
    v: torch.Tensor,
    flat_layer: torch.Tensor,
    meta: LoraMeta,
    first_module: int,
    out_offsets: tuple[int, ...],
    out_widths: tuple[int, ...],
    group: SegmentGroup | None = None,
    *,
    settings: KernelSettings,
) -> Relaunch | None:
    """The launch that adds (v·Bᵀ)·scale of modules first_module .. + len(out_widths) - 1 into y's columns (see
    top), called as launch(flat_layer, y) for any pool layer and y shaped like these (every layer of a step; v
    stays the one given here); None when the step has no adapter token.

    Every segment of `group` (default: the whole step) in one launch, with the shrink's kernel kind and tile shape
    (expand_config).
    """
    num_slices = len(out_widths)
    _check(y, v, flat_layer, meta, first_module, out_offsets, out_widths)
    group = meta.whole() if group is None else group
    cfg = expand_config(group, num_slices, settings)
    tiles = group.tiles(cfg.block_m)
    num_tiles = int(tiles.shape[0])
    if num_tiles == 0:
        return None
    offsets = tuple(out_offsets) + (0,) * (3 - num_slices)
    widths = tuple(out_widths) + (0,) * (3 - num_slices)
    block_n = expand_block_n(cfg, num_tiles, out_widths)
    blocks = column_blocks(out_widths, block_n * cfg.n_chunks)
    args = dict(
        v_ptr=v, stride_v_tok=v.stride(1), pool_ptr=flat_layer, y_ptr=y, stride_y=y.stride(0),
        tiles_ptr=tiles, ranks_ptr=meta.ranks, scales_ptr=meta.scales, row_start_ptr=meta.row_start,
        b_rows_ptr=meta.b_rows,
        offset0=offsets[0], offset1=offsets[1], offset2=offsets[2],
        width0=widths[0], width1=widths[1], width2=widths[2], blocks1=blocks[0], blocks2=blocks[1],
        FIRST_MODULE=first_module, NUM_SLICES=num_slices, ROW_ALIGN=meta.row_align,
        BLOCK_M=cfg.block_m, BLOCK_R=cfg.block_r, BLOCK_N=block_n, USE_PDL=pdl_enabled(y.device, settings),
    )  # fmt: skip
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if args["USE_PDL"]:
        options.update(launch_pdl=True)
    grid = (num_tiles, blocks[-1], 1)
    if cfg.gemv:
        args.update(stride_v_split=v.stride(0), split_k=v.shape[0], SPLITS=next_power_of_2(v.shape[0]))
        return Relaunch(_lora_expand_gemv_kernel, grid, args, options, changing=("pool_ptr", "y_ptr"))
    if v.shape[0] != 1:
        raise ValueError(f"the tensor-core expand reads the shrink's sums (one split of v), got {v.shape[0]} splits")
    args.update(N_CHUNKS=cfg.n_chunks, DOT_PRECISION=dot_precision(y.dtype), PREFETCH=cfg.prefetch)
    return Relaunch(_lora_expand_kernel, grid, args, options, changing=("pool_ptr", "y_ptr"))


def expand_block_n(cfg: ExpandConfig, num_tiles: int, widths: tuple[int, ...]) -> int:
    """The widest column block that still makes about cfg.target_programs programs (few tiles: narrow blocks)."""
    for block_n in cfg.block_n:
        if num_tiles * column_blocks(widths, block_n * cfg.n_chunks)[-1] >= cfg.target_programs:
            return block_n
    return cfg.block_n[-1]


def column_blocks(widths: tuple[int, ...], columns: int) -> tuple[int, int, int]:
    """Where each module's programs end on grid axis 1 (the last: the axis's length), `columns` columns a program."""
    ends = []
    total = 0
    for width in tuple(widths) + (0,) * (3 - len(widths)):
        total += cdiv(width, columns)
        ends.append(total)
    return ends[0], ends[1], ends[2]


def check_modules(first_module: int, out_offsets: tuple[int, ...], out_widths: tuple[int, ...]) -> None:
    """ValueError unless the call is 1 to 3 consecutive LoRA modules from first_module, an offset and width each."""
    if not 1 <= len(out_widths) <= 3 or len(out_offsets) != len(out_widths):
        raise ValueError(f"expected 1 to 3 fused modules, got offsets {out_offsets} and widths {out_widths}")
    if first_module < 0 or first_module + len(out_widths) > NUM_MODULES:
        raise ValueError(f"modules {first_module}..{first_module + len(out_widths) - 1} are not LoRA modules")


def _check(
    y: torch.Tensor,
    v: torch.Tensor,
    flat_layer: torch.Tensor,
    meta: LoraMeta,
    first_module: int,
    out_offsets: tuple[int, ...],
    out_widths: tuple[int, ...],
) -> None:
    check_modules(first_module, out_offsets, out_widths)
    if y.dim() != 2 or y.stride(1) != 1:
        raise ValueError(f"y must be [num_tokens, out] with unit column stride, got {tuple(y.shape)}")
    if max(o + w for o, w in zip(out_offsets, out_widths)) > y.shape[1]:
        raise ValueError(f"module outputs {out_offsets} + {out_widths} do not fit y's {y.shape[1]} columns")
    if v.dtype != torch.float32 or v.dim() != 3 or v.shape[1] != y.shape[0] or v.stride(2) != 1:
        raise ValueError(f"v must be float32 [split_k, {y.shape[0]}, R], got {v.dtype} {tuple(v.shape)}")
    if flat_layer.dim() != 1 or not flat_layer.is_contiguous() or flat_layer.dtype != y.dtype:
        raise ValueError("flat_layer must be one contiguous pool layer of y's dtype")
