"""The LoRA metadata of a captured graph: static buffers of one bucket, refilled from each step's LoraMeta.

A graph replays the grids and buffer shapes it was captured with (kernels/metadata.StaticBounds), so a step's
LoraMeta is copied into buffers sized for the bucket (its tokens and adapters) and the graph's rank bound:

    adapter rows 0 .. adapters-1   the step's adapters (ranks, scales, row starts)
    adapter row `adapters`         the null adapter: rank 0, never written
    tiles                          one per LoRA tile of the step; the rest name the null adapter and cover no token
    token_adapter                  the step's tokens, -1 (no adapter) for the padding rows

A decode graph (one token a sequence, so `size` tokens of at most `size` adapters) is cuda_graphs.py's; a graph of
steps with prompts (mixed_graphs.py) holds more tokens than adapters.

A graph for steps of many adapters launches the GEMV kernels on one-token tiles (`size` of them at most); one for
steps of at most `few_adapters` adapters (KernelSettings.few_adapters) the tensor-core kernels on 16-token tiles of
one adapter, at most size / 16 + few_adapters of them, so its grids stay sized for its tiles instead of one per
token.

With KernelSettings.graph_lora_split, a graph of steps with prompts launches, as an eager step does with lora_split,
its short segments (adapters of up to SHORT_SEGMENT tokens in the step: their decodes) on the GEMV kernels, a tile
a segment, and its long ones on prompt tiles: two static groups (LoraMeta.static_groups), each with its own rows of
one tile buffer, refilled from the step's segments on the host. A step of few adapters has long segments only (each
adapter's decodes and prompts are one segment): its graph (a variant of its own) has the prompt group alone. Without
it (the default), one group on 16-token tensor-core tiles.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from slora.backend.model.spec import LORA_MODULES
from slora.kernels.metadata import (
    SHORT_SEGMENT,
    TILE_COLUMNS,
    LoraMeta,
    SegmentGroup,
    StaticBounds,
    tile_rows,
    upload,
)
from slora.kernels.triton.launch import cdiv


class Tiling(NamedTuple):
    """One static launch group's tiles: `block` tokens a tile at most, the LoRA kernels' configs of `kind`
    (metadata.SegmentGroup.kind), room for `max_tiles` tiles, the shrink's K split planned for `grid_tiles` of them
    (StaticBounds.grid_tiles; 0: all)."""

    block: int
    kind: str
    max_tiles: int
    grid_tiles: int = 0


def tile_blocks() -> tuple[int, int, int]:
    """Tokens per tile of the LoRA kernels' decode (GEMV), mixed (16-token tensor-core) and prompt configs. Graphs
    run the Triton kernels only, so their configs are imported here, when one is built: the engine without graphs
    runs without the triton package."""
    from slora.kernels.triton import lora_shrink

    return lora_shrink.DECODE.block_m, lora_shrink.MIXED.block_m, lora_shrink.PREFILL.block_m


class StaticLora:
    """`meta`: the LoraMeta a graph is captured with; `fill` copies a step's metadata into it before a replay.

    Buffers for `tokens` tokens of at most `adapters` adapters, and a tile buffer for each of `tilings`: one, the
    step's segments in one launch group (meta.static), or two, its short segments apart from its long ones
    (meta.static_groups, see the module's docstring); the null adapter is row `adapters`."""

    def __init__(
        self,
        tokens: int,
        adapters: int,
        modules: frozenset[int],
        max_rank: int,
        row_align: int,
        device: torch.device,
        tilings: list[Tiling],
    ) -> None:
        """tilings: from decode_tiling or mixed_tiling."""
        if len(tilings) not in (1, 2):
            raise ValueError(f"a graph's LoRA runs in one launch group or two, not {len(tilings)}")
        self.size = tokens
        self.adapters = adapters
        self.tilings = tilings
        # every group's tiles: consecutive rows of one buffer, so that a step's are uploaded in one copy
        self._tiles = torch.zeros((sum(t.max_tiles for t in tilings), TILE_COLUMNS), dtype=torch.int32, device=device)
        self._tiles[:, 3] = adapters
        self.meta = self._empty_meta(modules, max_rank, row_align, device)
        self._filled: tuple[LoraMeta, int] | None = None  # the step metadata the buffers hold now

    def fill(self, meta: LoraMeta, n: int) -> None:
        """Copy the metadata of a step of n tokens (n <= the graph's tokens) into the buffers."""
        if self._filled is not None and self._filled[0] is meta and self._filled[1] == n:
            return  # a decode step of the same requests reuses its predecessor's LoraMeta (decode_batch.py)
        static = self.meta
        adapters = meta.ranks.shape[0]
        rows = meta.a_rows.shape[0]
        if adapters > self.adapters or rows > static.a_rows.shape[0]:
            raise ValueError(f"a step of {adapters} adapters ({rows} rows) does not fit a graph of {self.adapters} "
                             f"({static.a_rows.shape[0]} rows)")  # fmt: skip
        if len(self.tilings) == 1:
            self._fill_tiles(meta)
        else:
            upload(self._tiles, self.split_tiles(meta.seg_start_host, meta.seg_adapter_host))
        self._filled = (meta, n)
        static.ranks[:adapters].copy_(meta.ranks)
        static.scales[:adapters].copy_(meta.scales)
        static.row_start[:adapters].copy_(meta.row_start)
        static.a_rows[:rows].copy_(meta.a_rows)
        static.b_rows[:rows].copy_(meta.b_rows)
        static.token_adapter[:n].copy_(meta.token_adapter)
        static.token_adapter[n:].fill_(-1)

    def _fill_tiles(self, meta: LoraMeta) -> None:
        """One launch group: the step's tiles, then tiles of the null adapter covering no token."""
        tiles = self._tiles
        step_tiles = meta.tiles(self.tilings[0].block)
        count = step_tiles.shape[0]
        if count > tiles.shape[0]:
            raise ValueError(f"a step of {count} LoRA tiles does not fit a graph of {tiles.shape[0]}")
        tiles[:count].copy_(step_tiles)
        tiles[count:, 1:3].zero_()
        tiles[count:, 3].fill_(self.adapters)

    def split_tiles(self, seg_start: list[int], seg_adapter: list[int]) -> torch.Tensor:
        """Host int32 rows of the tile buffer of two launch groups: the tiles of the segments of up to SHORT_SEGMENT
        tokens (of the first group's block), then those of the long segments (of the second group's block), each
        group padded to its rows with tiles of the null adapter (no token). The same tiles, in the same order, as an
        eager step's groups (metadata.length_groups, tiles_of) at these blocks."""
        starts = np.asarray(seg_start, dtype=np.int64)
        count = starts.shape[0] - 1
        segments = np.stack([np.arange(count), starts[:-1], starts[1:], np.asarray(seg_adapter, dtype=np.int64)], 1)
        is_short = segments[:, 2] - segments[:, 1] <= SHORT_SEGMENT
        groups = []
        for tiling, chosen in zip(self.tilings, (segments[is_short], segments[~is_short]), strict=True):
            tiles = tile_rows(chosen, tiling.block)
            if tiles.shape[0] > tiling.max_tiles:
                raise ValueError(f"a step of {tiles.shape[0]} LoRA tiles of {tiling.block} tokens does not fit "
                                 f"the graph's {tiling.max_tiles}")  # fmt: skip
            rows = np.zeros((tiling.max_tiles, TILE_COLUMNS), dtype=np.int32)
            rows[:, 3] = self.adapters
            rows[: tiles.shape[0]] = tiles
            groups.append(rows)
        return torch.from_numpy(np.concatenate(groups))

    def _empty_meta(self, modules: frozenset[int], max_rank: int, row_align: int, device: torch.device) -> LoraMeta:
        columns = len(LORA_MODULES)
        bounds = []
        first = 0
        for tiling in self.tilings:
            tiles = self._tiles[first : first + tiling.max_tiles]
            segment_len = {"decode": 1, "short": SHORT_SEGMENT}.get(tiling.kind, SHORT_SEGMENT + 1)
            bounds.append(StaticBounds(max_rank, tiles, tiling.block, modules, tiling.kind, segment_len,
                                       tiling.grid_tiles))  # fmt: skip
            first += tiling.max_tiles
        groups = [SegmentGroup([], device, b) for b in bounds] if len(bounds) > 1 else None
        return LoraMeta(
            token_adapter=torch.full((self.size,), -1, dtype=torch.int32, device=device),
            seg_start=torch.zeros(self.adapters + 1, dtype=torch.int32, device=device),
            seg_adapter=torch.zeros(self.adapters, dtype=torch.int32, device=device),
            ranks=torch.zeros((self.adapters + 1, columns), dtype=torch.int32, device=device),
            scales=torch.zeros((self.adapters + 1, columns), dtype=torch.float32, device=device),
            row_start=torch.zeros((self.adapters + 1, columns), dtype=torch.int32, device=device),
            a_rows=torch.zeros(self.adapters * columns * max_rank, dtype=torch.int64, device=device),
            b_rows=torch.zeros(self.adapters * columns * max_rank, dtype=torch.int64, device=device),
            max_rank=max_rank,
            seg_start_host=[],
            seg_adapter_host=[],
            ranks_host=[],
            scales_host=[],
            row_start_host=[],
            row_align=row_align,
            static=bounds[-1],
            static_groups=groups,
        )


def decode_tiling(size: int, few_adapters: int | None) -> list[Tiling]:
    """The tiling of a decode graph of `size` sequences: one-token GEMV tiles, or with few_adapters (the most
    adapters of the steps it replays) 16-token tensor-core tiles: a full tile per 16 tokens and a partial one per
    adapter at most."""
    decode_block, few_block, _ = tile_blocks()
    if few_adapters is None:
        return [Tiling(decode_block, "decode", size)]
    return [Tiling(few_block, "mixed", cdiv(size, few_block) + few_adapters)]


def mixed_tiling(tokens: int, adapters: int, split: bool, few_adapters: int | None = None) -> list[Tiling]:
    """The tilings of a graph of steps with prompts of `tokens` tokens over at most `adapters` adapters.

    split (KernelSettings.graph_lora_split): two groups, as an eager step launches them. Short segments (up to
    SHORT_SEGMENT tokens) on the GEMV kernels, a tile each (kind "short"), so at most one per adapter; long segments
    on prompt tiles, a full tile per prompt-tile of tokens and a partial one per long segment (more than
    SHORT_SEGMENT tokens each, and one per adapter) at most, the K split planned for the full tiles alone. With
    few_adapters (the most adapters of the steps it replays, KernelSettings.few_adapters): their segments are long,
    so one group of prompt tiles, as an eager step of few adapters has. Without split, one group on 16-token
    tensor-core tiles, a full tile per 16 tokens and a partial one per adapter at most."""
    _, few_block, prompt_block = tile_blocks()
    if not split:
        return [Tiling(few_block, "mixed", cdiv(tokens, few_block) + adapters)]
    full = cdiv(tokens, prompt_block)
    if few_adapters is not None:
        return [Tiling(prompt_block, "prompts", full + few_adapters, full)]
    long_segments = min(adapters, tokens // (SHORT_SEGMENT + 1))
    return [
        Tiling(SHORT_SEGMENT, "short", min(tokens, adapters)),
        Tiling(prompt_block, "prompts", full + long_segments, full),
    ]
