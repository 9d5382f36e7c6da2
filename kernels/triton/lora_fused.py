"""LoRA shrink and expand in one kernel, one token at a time: y_t[cols_m] += ((x_t · A_mᵀ) · B_m) · scale_m.

For steps of many adapters with a token each (a saturated server's decode steps and their CUDA graphs, and the
decodes of its eager steps with prompts, launched apart from the prompts), of ranks up to MAX_RANK: the engine
launches it for those with EngineConfig.lora_fused (lora_call.py), in place of the shrink and expand launch pair.
perf/bench_kernels.py times it against the pair ("triton_fused"). One program takes one tile of up to BLOCK_M
tokens of one segment (one adapter) and one module of the call (grid axis 1): for each token it reads the adapter's
A rows along the input features (x_t · Aᵀ, kept in registers: the program's rank fits one BLOCK_R chunk), then
its Bᵀ rows along the module's output columns, and adds the scaled product into y. The pair's partial sums v never
go through memory, and a call is one launch instead of two; what it gives up is parallelism across K splits and
column blocks, so a step of few tokens runs few, long programs, and a program's rank chunk is its whole rank, so a
large rank narrows its steps along K and N (FusedConfig.max_tile).

Launched with PDL behind the Triton projection GEMM (kernels/triton/pdl.py), a program computes its v from x and A,
which the GEMM does not write, then waits for the GEMM before it reads and adds into y, the GEMM's output.

    x: [num_tokens, in]                         pool layer (flat): lora_A rows (in elements) and lora_Bᵀ rows
    y: [num_tokens, ≥ Σ out_m]                  (out_m elements), anywhere in the pool (LoraMeta's row tables)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from slora.kernels.metadata import LoraMeta, SegmentGroup
from slora.kernels.settings import KernelSettings
from slora.kernels.triton.launch import next_power_of_2
from slora.kernels.triton.lora_expand import check_modules, module_of_program
from slora.kernels.triton.lora_shrink import MODULES, tile_bounds
from slora.kernels.triton.pdl import shrink_pdl
from slora.kernels.triton.relaunch import Relaunch


@dataclass(frozen=True)
class FusedConfig:
    block_m: int  # tokens per tile: a decode's tile holds its one token, a prompt's up to block_m
    block_k: int  # input features per step of the shrink loop, at most
    block_n: int  # output columns per step of the expand loop, at most
    num_warps: int
    num_stages: int
    # Elements of A or Bᵀ one loop step loads at most: a step's rows are the call's rank bound, so a larger rank
    # takes narrower steps instead of more registers than the program's warps hold.
    max_tile: int = 8192

    def steps(self, block_r: int) -> tuple[int, int]:
        """(block_k, block_n) for rank chunks of block_r rows."""
        cap = max(self.max_tile // block_r, 16)
        return min(self.block_k, cap), min(self.block_n, cap)


# One-token tiles and the widest steps: the "served decode" sweep of perf/bench_kernels.py (perf/RESULTS.md).
DEFAULT = FusedConfig(1, 1024, 1024, 4, 2)
# The engine launches the kernel for steps whose rank bound (a power of two) is at most this; larger ranks keep
# the launch pair, whose rank chunks spread over programs instead of narrowing each program's steps.
MAX_RANK = 16


@triton.jit(do_not_specialize=["stride_x", "stride_y"])
def _lora_fused_kernel(
    x_ptr,  # [num_tokens, in_features], unit column stride
    stride_x,
    pool_ptr,  # one pool layer, flat
    y_ptr,  # [num_tokens, ≥ Σ out_m], unit column stride (updated in place)
    stride_y,
    tiles_ptr,  # int32 [num_tiles, 4]: (segment, first token, segment end, adapter)
    ranks_ptr,  # int32 [num_adapters, 7]
    scales_ptr,  # float32 [num_adapters, 7]
    row_start_ptr,  # int32 [num_adapters, 7]: each module's first entry in the row tables
    a_rows_ptr,  # int64 [total_rows]: flat pool offset of each lora_A row
    b_rows_ptr,  # int64 [total_rows]: flat pool offset of each lora_Bᵀ row
    in_features,
    offset0,  # first column in y of each module of the call, and its width
    offset1,
    offset2,
    width0,
    width1,
    width2,
    FIRST_MODULE: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,  # a power of two at least every module's rank
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with PDL behind the projection that wrote y (kernels/triton/pdl.py)
):
    if USE_PDL:
        gdc_launch_dependents()
    s = tl.program_id(1)
    first, end, adapter = tile_bounds(tiles_ptr, tl.program_id(0))
    rank, row0, scale, offset, width, _ = module_of_program(
        ranks_ptr, scales_ptr, row_start_ptr, adapter * MODULES + FIRST_MODULE, s,
        offset0, offset1, offset2, width0, width1, width2, NUM_SLICES,
    )  # fmt: skip
    if rank > 0:
        j = tl.arange(0, BLOCK_R)
        j_mask = j < rank
        a_rows = tl.multiple_of(tl.load(a_rows_ptr + row0 + j, mask=j_mask, other=0), ROW_ALIGN)
        b_rows = tl.multiple_of(tl.load(b_rows_ptr + row0 + j, mask=j_mask, other=0), ROW_ALIGN)
        for i in range(0, tl.minimum(end - first, BLOCK_M)):  # the tile's tokens (rows first + i)
            t = first.to(tl.int64) + i
            v = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for k0 in range(0, in_features, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_mask = k < in_features
                xt = tl.load(x_ptr + t * stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
                at = tl.load(pool_ptr + a_rows[:, None] + k[None, :], mask=j_mask[:, None] & k_mask[None, :],
                             other=0.0)  # fmt: skip
                v += tl.sum(at.to(tl.float32) * xt[None, :], axis=1)
            if USE_PDL:
                gdc_wait()  # y is the projection's output (a no-op once it has ended)
            y_row = y_ptr + t * stride_y + offset
            for n0 in range(0, width, BLOCK_N):
                n = n0 + tl.arange(0, BLOCK_N)
                n_mask = n < width
                bt = tl.load(pool_ptr + b_rows[:, None] + n[None, :], mask=j_mask[:, None] & n_mask[None, :],
                             other=0.0)  # fmt: skip
                delta = tl.sum(v[:, None] * bt.to(tl.float32), axis=0)
                yt = tl.load(y_row + n, mask=n_mask, other=0.0)
                tl.store(y_row + n, (yt.to(tl.float32) + delta * scale).to(yt.dtype), mask=n_mask)
    if USE_PDL:
        gdc_wait()  # also a program with nothing to add: the kernel must not end before the projection


def rank_block(meta: LoraMeta) -> int:
    """The power of two of rows a program's v holds: the step's largest rank (a graph's metadata holds its rank
    bound there)."""
    return max(next_power_of_2(meta.max_rank), 2)


def fused_serves(group: SegmentGroup, meta: LoraMeta, settings: KernelSettings) -> bool:
    """Whether the engine launches the fused kernel for `group`: settings.lora_fused, a group of decodes on the
    GEMV kernels' configs (SegmentGroup.kind) and a rank bound of at most MAX_RANK."""
    return settings.lora_fused and group.kind(settings) == "decode" and rank_block(meta) <= MAX_RANK


def fused_launch(
    y: torch.Tensor,
    x: torch.Tensor,
    flat_layer: torch.Tensor,
    meta: LoraMeta,
    first_module: int,
    out_offsets: tuple[int, ...],
    out_widths: tuple[int, ...],
    group: SegmentGroup | None = None,
    pdl: bool = False,
    *,
    settings: KernelSettings,
    cfg: FusedConfig | None = None,
) -> Relaunch | None:
    """The launch that adds the LoRA of modules first_module .. + len(out_widths) - 1 (at most 3) into y's columns,
    for every token of `group` (default: the whole step), called as launch(x, flat_layer, y) for any x, pool layer
    and y shaped like these (every layer of a step); None when the group has no token. A graph's static tiles keep
    the token count they were built for. pdl: launched with PDL behind the Triton projection GEMM that wrote y
    (where `settings` and kernels/triton/pdl.py allow it). cfg: DEFAULT, looked up at each call (sweeps set it)."""
    cfg = DEFAULT if cfg is None else cfg
    num_slices = len(out_widths)
    check_modules(first_module, out_offsets, out_widths)
    if x.dim() != 2 or x.stride(1) != 1 or y.dim() != 2 or y.stride(1) != 1 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y must be [num_tokens, features] with unit column stride, got {tuple(x.shape)} "
                         f"and {tuple(y.shape)}")  # fmt: skip
    group = meta.whole() if group is None else group
    block_m = group.static.tile_block if group.static is not None else cfg.block_m
    tiles = group.tiles(block_m)
    if tiles.shape[0] == 0:
        return None
    offsets = tuple(out_offsets) + (0,) * (3 - num_slices)
    widths = tuple(out_widths) + (0,) * (3 - num_slices)
    block_r = rank_block(meta)
    block_k, block_n = cfg.steps(block_r)
    args = dict(
        x_ptr=x, stride_x=x.stride(0), pool_ptr=flat_layer, y_ptr=y, stride_y=y.stride(0), tiles_ptr=tiles,
        ranks_ptr=meta.ranks, scales_ptr=meta.scales, row_start_ptr=meta.row_start, a_rows_ptr=meta.a_rows,
        b_rows_ptr=meta.b_rows, in_features=x.shape[1],
        offset0=offsets[0], offset1=offsets[1], offset2=offsets[2],
        width0=widths[0], width1=widths[1], width2=widths[2],
        FIRST_MODULE=first_module, NUM_SLICES=num_slices, ROW_ALIGN=meta.row_align, BLOCK_M=block_m,
        BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N=block_n, USE_PDL=pdl and shrink_pdl(y.device, settings),
    )  # fmt: skip
    options: dict[str, object] = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if args["USE_PDL"]:
        options.update(launch_pdl=True)
    grid = (int(tiles.shape[0]), num_slices, 1)
    return Relaunch(_lora_fused_kernel, grid, args, options, changing=("x_ptr", "pool_ptr", "y_ptr"))


def fused_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    flat_layer: torch.Tensor,
    meta: LoraMeta,
    first_module: int,
    out_offsets: tuple[int, ...],
    out_widths: tuple[int, ...],
    group: SegmentGroup | None = None,
    cfg: FusedConfig | None = None,
) -> None:
    """y[:, out_offsets[i] : + out_widths[i]] += LoRA of module first_module + i, for every token of `group`
    (default: the whole step), in one launch without PDL, whatever the group's kind and rank (fused_launch)."""
    launch = fused_launch(y, x, flat_layer, meta, first_module, out_offsets, out_widths, group, settings=_PLAIN,
                          cfg=cfg)  # fmt: skip
    if launch is not None:
        launch(x, flat_layer, y)


_PLAIN = KernelSettings(lora_pdl=False)
