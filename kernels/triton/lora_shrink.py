"""LoRA shrink over the unified pool: v = x · Aᵀ for every token, with each token's own adapter and rank.

Punica's SGMV / S-LoRA's MBGMM for segments of many tokens, and BGMV / MBGMV for decode, in one kernel whose
tile sizes come from a config table. Tokens are grouped by adapter into segments (LoraMeta). Grid: (tile, rank
program, K split). A tile is up to BLOCK_M tokens of one segment; rank program p takes the rank chunks p,
p + P, ... (BLOCK_R rows each) of the tile's adapter; a K split is one slice of the input features. The
projections of one call (q, k, v or gate, up) share the input, so their A rows are one run in the row table and
are computed together as one rank range: x is read for all of them at once.

    x: [num_tokens, in]            pool layer (flat): rows of lora_A, in elements each, anywhere in the pool
    v: [split_k, num_tokens, R]    float32; for a token of adapter a, columns 0 .. rank_a - 1 hold its partial
                                   sums (q ranks first, then k, then v); the other columns are never written

Steps of decodes only (tiles of one or a few tokens) go to a GEMV kernel with the same grid and output, which spends no
tensor-core tile on padding rows. Work follows each adapter's own rank: rank chunks past it are skipped and rows
past it inside the last chunk are masked (never loaded). Tokens of no adapter belong to no tile.

Who sums the split_k partials: the GEMV expand kernel loads a token's partials in one go. The tensor-core shrink sums
them itself: the last program of a (tile, rank program) to finish, counted on a semaphore, adds the splits' partials
in split order into split 0, so the expand reads one v. Otherwise every expand program (one per column block and
module) re-read and summed every split, a chain of split_k dependent loads per rank chunk.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from slora.kernels.metadata import SHORT_SEGMENT, LoraMeta, SegmentGroup, to_device
from slora.kernels.settings import DEFAULT_SETTINGS, KernelSettings
from slora.kernels.triton.launch import cdiv, dot_precision
from slora.kernels.triton.pdl import pdl_enabled, shrink_pdl
from slora.kernels.triton.relaunch import Relaunch

NUM_MODULES = 7  # q, k, v, o, gate, up, down: the columns of LoraMeta's tables
MODULES = tl.constexpr(NUM_MODULES)  # the same, readable inside kernels


@dataclass(frozen=True)
class ShrinkConfig:
    block_m: int  # tokens per tile
    block_r: int  # rank rows per chunk
    block_k: int  # input features per inner step
    target_programs: int  # spread rank chunks, then split K, until about this many programs run
    num_warps: int
    num_stages: int
    # The GEMV kernel (one token at a time on CUDA cores, A reused from cache for the tile's next tokens) instead
    # of tensor-core tiles: decode tiles hold one or two tokens, for which a tl.dot tile is mostly padding.
    gemv: bool = False


MAX_SPLIT_K = 16  # K splits at most: each adds a partial sum of v that the expand kernel reads back

# Picked by the step's segments (shrink_config): the GEMV kernel for a step of decodes only, tensor-core tiles of
# decode shape for a step that mixes decodes with prompts, prompt-shaped ones for a step of prompts only.
# GEMV: tiles of one token, one K block per program. With a few adapters for the whole batch (many tokens each),
# one-token tiles make more programs, each a short chain, where a tile of several tokens runs them one after the
# other. The configs' numbers are those of the kernel sweeps on the H200 (perf/RESULTS.md).
DECODE = ShrinkConfig(1, 16, 1024, 1 << 20, 4, 2, gemv=True)
# Decode calls of one module (o, down) share DECODE: no config of their own swept ahead of it; their expand config
# differs (lora_expand.DECODE_ONE).
DECODE_ONE = DECODE
MIXED = ShrinkConfig(16, 32, 128, 512, 4, 3)
PREFILL = ShrinkConfig(64, 16, 64, 512, 4, 3)


def shrink_config(group: SegmentGroup, num_slices: int, settings: KernelSettings = DEFAULT_SETTINGS) -> ShrinkConfig:
    """The config of a call of num_slices fused modules on the group's segments (their kind: settings' rule)."""
    kind = group.kind(settings)
    if kind in ("decode", "short"):
        cfg = DECODE_ONE if num_slices == 1 else DECODE
        # a graph's short segments: a tile of a whole segment, whose tokens the GEMV kernel runs one after another
        return cfg if kind == "decode" else dataclasses.replace(cfg, block_m=SHORT_SEGMENT)
    return MIXED if kind == "mixed" else PREFILL


@triton.jit
def tile_bounds(tiles_ptr, tile):
    """(first token, end of its segment, adapter) of a tile (metadata.tiles_of's rows)."""
    first = tl.load(tiles_ptr + 4 * tile + 1)
    end = tl.load(tiles_ptr + 4 * tile + 2)
    adapter = tl.load(tiles_ptr + 4 * tile + 3)
    return first, end, adapter


@triton.jit
def fused_rows(ranks_ptr, row_start_ptr, table, NUM_SLICES: tl.constexpr):
    """(total rank, first row-table entry) of the NUM_SLICES modules from `table` (adapter * 7 + first module)."""
    rank = tl.load(ranks_ptr + table)
    for s in tl.static_range(1, NUM_SLICES):
        rank += tl.load(ranks_ptr + table + s)
    return rank, tl.load(row_start_ptr + table)


# stride_v_split (num_tokens × rank) changes every step; stride_v_tok is v's width, the step's largest fused rank:
# specialized, a step whose adapters all have ranks not divisible by 16 (S2's rank 8: 24 for q, k, v) would compile
# variants of its own while serving.
@triton.jit(do_not_specialize=["stride_v_split", "stride_v_tok"])
def _lora_shrink_kernel(
    x_ptr,  # [num_tokens, in_features], unit column stride
    stride_x,  # row stride of x
    pool_ptr,  # one pool layer, flat: A rows live at the offsets in a_rows
    v_ptr,  # float32 [split_k, num_tokens, R] partial sums (written)
    stride_v_split,
    stride_v_tok,
    tiles_ptr,  # int32 [num_tiles, 4]: (segment, first token, segment end, adapter)
    ranks_ptr,  # int32 [num_adapters, 7]
    row_start_ptr,  # int32 [num_adapters, 7]: first entry of each (adapter, module) in a_rows
    a_rows_ptr,  # int64 [total_rows]: flat pool offset of each lora_A row
    in_features,
    k_per_split,  # input features per split (a multiple of BLOCK_K)
    arrivals_ptr,  # int32 [num_tiles * rank programs], zero between launches: splits done per (tile, rank program)
    # (whether K is split is read from the grid, not passed as a constexpr: one compiled variant serves a step of
    # many tiles, one split, and a step of few, split; with a constexpr the warm-up missed one of the two)
    FIRST_MODULE: tl.constexpr,  # first module of the call (0 for q, k, v)
    NUM_SLICES: tl.constexpr,  # consecutive modules fused in the call (3 for q, k, v)
    ROW_ALIGN: tl.constexpr,  # every A row offset is a multiple of this
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,  # let the expand start now; end after the kernel in front (kernels/triton/pdl.py)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs (no tf32 rounding)
):
    if USE_PDL:
        gdc_launch_dependents()
    split = tl.program_id(2)
    first, end, adapter = tile_bounds(tiles_ptr, tl.program_id(0))
    rank, row0 = fused_rows(ranks_ptr, row_start_ptr, adapter * MODULES + FIRST_MODULE, NUM_SLICES)

    tokens = first + tl.arange(0, BLOCK_M)
    tok_mask = tokens < end
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_x
    k_lo = split * k_per_split
    v_base = v_ptr + split.to(tl.int64) * stride_v_split + tokens.to(tl.int64)[:, None] * stride_v_tok
    # This program's rank chunks: p, p + P, ... for rank program p of P (grid axis 1), up to the adapter's rank.
    for c in range(tl.program_id(1) * BLOCK_R, rank, tl.num_programs(1) * BLOCK_R):
        j = c + tl.arange(0, BLOCK_R)
        j_mask = j < rank
        rows = tl.load(a_rows_ptr + row0 + j, mask=j_mask, other=0)
        rows = tl.multiple_of(rows, ROW_ALIGN)
        acc = split_dot(x_rows, tok_mask, pool_ptr, rows, j_mask, k_lo, k_per_split, in_features, BLOCK_M, BLOCK_R,
                        BLOCK_K, DOT_PRECISION)  # fmt: skip
        tl.store(v_base + j[None, :], acc, mask=tok_mask[:, None] & j_mask[None, :])
    if tl.num_programs(2) > 1:  # K is split: the last split to finish sums the partials into split 0 (see top)
        group = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        tl.debug_barrier()  # every thread's partial stored before the arrival is counted (released by the atomic)
        if tl.atomic_add(arrivals_ptr + group, 1, sem="acq_rel") == tl.num_programs(2) - 1:
            v_rows = v_ptr + tokens.to(tl.int64)[:, None] * stride_v_tok
            sum_split_partials(
                v_rows, stride_v_split, tok_mask, rank, tl.num_programs(2), tl.program_id(1) * BLOCK_R,
                tl.num_programs(1) * BLOCK_R, BLOCK_R,
            )  # fmt: skip
            tl.atomic_xchg(arrivals_ptr + group, 0)  # ready for the next layer's launch
    if USE_PDL:
        gdc_wait()  # launched with PDL behind the base projection: end after it (kernels/triton/pdl.py)


@triton.jit
def split_dot(
    x_rows, tok_mask, pool_ptr, rows, j_mask, k_lo, k_per_split, in_features, BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """[BLOCK_M, BLOCK_R] float32: the tile's x rows (x_rows: [BLOCK_M, 1] pointers) times the A rows at pool offsets
    `rows`, over input features k_lo .. k_lo + k_per_split - 1 (one K split), on tensor cores."""
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for kk in range(0, k_per_split, BLOCK_K):
        k = k_lo + kk + tl.arange(0, BLOCK_K)
        k_mask = k < in_features
        xt = tl.load(x_rows + k[None, :], mask=tok_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(pool_ptr + rows[:, None] + k[None, :], mask=j_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(xt, tl.trans(at), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def sum_split_partials(
    v_rows, stride_v_split, tok_mask, rank, splits, first_chunk, chunk_step, BLOCK_R: tl.constexpr
):  # fmt: skip
    """Split 0 of v := the sum, in split order, of the `splits` splits' partials, in the rank chunks first_chunk,
    first_chunk + chunk_step, ... below `rank`, for the tile's tokens (v_rows: [BLOCK_M, 1] pointers into split 0).
    Loads bypass L1: other SMs wrote the partials."""
    for c in range(first_chunk, rank, chunk_step):
        j = c + tl.arange(0, BLOCK_R)
        mask = tok_mask[:, None] & (j < rank)[None, :]
        total = tl.load(v_rows + j[None, :], mask=mask, other=0.0, cache_modifier=".cg")
        for sp in range(1, splits):
            total += tl.load(v_rows + sp * stride_v_split + j[None, :], mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(v_rows + j[None, :], total, mask=mask)


@triton.jit(do_not_specialize=["stride_v_split", "stride_v_tok"])  # v's width: the graph's rank bound or the step's
def _lora_shrink_gemv_kernel(
    x_ptr,
    stride_x,
    pool_ptr,
    v_ptr,
    stride_v_split,
    stride_v_tok,
    tiles_ptr,
    ranks_ptr,
    row_start_ptr,
    a_rows_ptr,
    in_features,
    k_per_split,
    FIRST_MODULE: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The dot kernel's work (same arguments, grid and output) one token at a time: v_t = Σ_k A[:, k] · x_t[k] as
    an elementwise product summed along K, in float32. The tile's later tokens read A again, from cache."""
    if USE_PDL:
        gdc_launch_dependents()
    split = tl.program_id(2)
    first, end, adapter = tile_bounds(tiles_ptr, tl.program_id(0))
    rank, row0 = fused_rows(ranks_ptr, row_start_ptr, adapter * MODULES + FIRST_MODULE, NUM_SLICES)

    k_lo = split * k_per_split
    v_split = v_ptr + split.to(tl.int64) * stride_v_split
    for c in range(tl.program_id(1) * BLOCK_R, rank, tl.num_programs(1) * BLOCK_R):
        j = c + tl.arange(0, BLOCK_R)
        j_mask = j < rank
        rows = tl.load(a_rows_ptr + row0 + j, mask=j_mask, other=0)
        rows = tl.multiple_of(rows, ROW_ALIGN)
        for i in range(0, tl.minimum(end - first, BLOCK_M)):  # the tile's tokens (rows first + i)
            t = first.to(tl.int64) + i
            x_row = x_ptr + t * stride_x
            acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for kk in range(0, k_per_split, BLOCK_K):
                k = k_lo + kk + tl.arange(0, BLOCK_K)
                k_mask = k < in_features
                xt = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)
                at = tl.load(pool_ptr + rows[:, None] + k[None, :], mask=j_mask[:, None] & k_mask[None, :], other=0.0)
                acc += tl.sum(at.to(tl.float32) * xt[None, :], axis=1)
            tl.store(v_split + t * stride_v_tok + j, acc, mask=j_mask)
    if USE_PDL:
        gdc_wait()  # launched with PDL behind the base projection: end after it (kernels/triton/pdl.py)


def shrink_launch(
    x: torch.Tensor,
    flat_layer: torch.Tensor,
    meta: LoraMeta,
    first_module: int,
    num_slices: int,
    group: SegmentGroup | None = None,
    pdl: bool = False,
    *,
    settings: KernelSettings,
) -> tuple[torch.Tensor, Relaunch | None]:
    """v [splits, num_tokens, R] (allocated here) and the launch that writes into it the partial sums of x·Aᵀ for
    modules first_module .. + num_slices - 1 (see top), called as launch(x, flat_layer) for any x and pool layer
    shaped like these (every layer of a step); None when the step has no adapter token or the modules no rank.
    v's splits are the K splits for the GEMV kernel, one (their sum) for the tensor-core kernel.

    Every segment of `group` (default: the whole step) in one launch (kernel and tile shape: shrink_config); rows of
    other tokens are left unwritten. pdl: launched with PDL (where `settings` and kernels/triton/pdl.py allow it), for
    a shrink right behind the Triton projection GEMM that wrote the y its expand adds into.
    """
    _check(x, flat_layer, meta, first_module, num_slices)
    group = meta.whole() if group is None else group
    cfg = shrink_config(group, num_slices, settings)
    fused_rank = meta.fused_rank(first_module, num_slices)
    tiles = group.tiles(cfg.block_m)
    num_tiles = int(tiles.shape[0])
    in_features = int(x.shape[1])
    planned = group.static.grid_tiles if group.static is not None and group.static.grid_tiles else num_tiles
    rank_programs, split_k, k_per_split = shrink_grid(cfg, planned, fused_rank, in_features)
    v = torch.empty((split_k, x.shape[0], max(fused_rank, 1)), dtype=torch.float32, device=x.device)
    if num_tiles == 0 or fused_rank == 0:
        return v, None
    args = dict(
        x_ptr=x, stride_x=x.stride(0), pool_ptr=flat_layer, v_ptr=v,
        stride_v_split=v.stride(0), stride_v_tok=v.stride(1),
        tiles_ptr=tiles, ranks_ptr=meta.ranks, row_start_ptr=meta.row_start, a_rows_ptr=meta.a_rows,
        in_features=in_features, k_per_split=k_per_split,
        FIRST_MODULE=first_module, NUM_SLICES=num_slices, ROW_ALIGN=meta.row_align,
        BLOCK_M=cfg.block_m, BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k, USE_PDL=pdl_enabled(x.device, settings),
    )  # fmt: skip
    kernel = _lora_shrink_gemv_kernel
    v_out = v
    if not cfg.gemv:
        kernel = _lora_shrink_kernel
        # Zeroed by a copy, not a kernel: a shrink launched with PDL may start before a kernel in front has ended.
        arrivals = to_device(torch.zeros(num_tiles * rank_programs, dtype=torch.int32), x.device)
        args.update(arrivals_ptr=arrivals, DOT_PRECISION=dot_precision(x.dtype))
        v_out = v[:1]  # the expand reads the sums in split 0 only
    options: dict[str, object] = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if pdl and shrink_pdl(x.device, settings):
        options.update(launch_pdl=True)
    grid = (num_tiles, rank_programs, split_k)
    return v_out, Relaunch(kernel, grid, args, options, changing=("x_ptr", "pool_ptr"))


def shrink_grid(cfg: ShrinkConfig, num_tiles: int, fused_rank: int, in_features: int) -> tuple[int, int, int]:
    """(rank programs, K splits, features per split) for about cfg.target_programs programs.

    Rank chunks are spread over programs first (that costs no extra traffic); K is split only when there are
    still too few, into a power of two of splits (each split adds a partial sum of v to write and read).
    """
    tiles = max(1, num_tiles)
    rank_programs = max(1, min(cdiv(fused_rank, cfg.block_r), cfg.target_programs // tiles))
    k_blocks = cdiv(in_features, cfg.block_k)
    wanted = max(1, min(k_blocks, MAX_SPLIT_K, cfg.target_programs // (tiles * rank_programs)))
    splits = 1 << (wanted.bit_length() - 1)
    k_per_split = cdiv(k_blocks, splits) * cfg.block_k
    return rank_programs, cdiv(in_features, k_per_split), k_per_split


def _check(x: torch.Tensor, flat_layer: torch.Tensor, meta: LoraMeta, first_module: int, num_slices: int) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [num_tokens, in_features] with unit column stride, got {tuple(x.shape)}")
    if flat_layer.dim() != 1 or not flat_layer.is_contiguous() or flat_layer.dtype != x.dtype:
        raise ValueError("flat_layer must be one contiguous pool layer of x's dtype")
    if num_slices < 1 or first_module < 0 or first_module + num_slices > NUM_MODULES:
        raise ValueError(f"modules {first_module}..{first_module + num_slices - 1} are not LoRA modules")
    if meta.a_rows.dtype != torch.int64 or meta.ranks.shape[1:] != (NUM_MODULES,):
        raise ValueError("LoraMeta must have int64 row offsets and [num_adapters, 7] rank tables")
