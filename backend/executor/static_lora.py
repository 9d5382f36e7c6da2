"""The LoRA metadata of a captured graph: static buffers of one bucket, refilled from each step's LoraMeta.

A graph replays the grids and buffer shapes it was captured with (kernels/metadata.StaticBounds), so a step's
LoraMeta is copied into buffers sized for the bucket (its tokens and adapters) and the graph's rank bound:

    adapter rows 0 .. adapters-1   the step's adapters (ranks, scales, row starts)
    adapter row `adapters`         the null adapter: rank 0, never written
    tiles                          one per LoRA tile of the step; the rest name the null adapter and cover no token
    token_adapter                  the step's tokens, -1 (no adapter) for the padding rows

A decode graph (one token a sequence, so `size` tokens of at most `size` adapters) is cuda_graphs.py's; a graph of
steps with prompts (mixed_graphs.py) holds more tokens than adapters and always runs 16-token tensor-core tiles.

A graph for steps of many adapters launches the GEMV kernels on one-token tiles (`size` of them at most); one for
steps of at most `few_adapters` adapters (KernelSettings.few_adapters) the tensor-core kernels on 16-token tiles of
one adapter, at most size / 16 + few_adapters of them, so its grids stay sized for its tiles instead of one per
token.
"""

from __future__ import annotations

import torch

from slora.backend.model.spec import LORA_MODULES
from slora.kernels.metadata import TILE_COLUMNS, LoraMeta, StaticBounds
from slora.kernels.triton.launch import cdiv


def tile_blocks() -> tuple[int, int]:
    """Tokens per tile of a graph for many adapters (the LoRA kernels' decode configs) and of one for few adapters
    (their mixed configs). Graphs run the Triton kernels only, so their configs are imported here, when one is
    built: the engine without graphs runs without the triton package."""
    from slora.kernels.triton import lora_shrink

    return lora_shrink.DECODE.block_m, lora_shrink.MIXED.block_m


class StaticLora:
    """`meta`: the LoraMeta a graph is captured with; `fill` copies a step's metadata into it before a replay.

    Buffers for `tokens` tokens of at most `adapters` adapters, `max_tiles` tiles of `tile_block` tokens run on the
    LoRA kernels' configs of `kind` (metadata.SegmentGroup.kind); the null adapter is row `adapters`."""

    def __init__(
        self,
        tokens: int,
        adapters: int,
        modules: frozenset[int],
        max_rank: int,
        row_align: int,
        device: torch.device,
        tiling: tuple[int, str, int],
    ) -> None:
        """tiling: (tile_block, kind, max_tiles), from decode_tiling or mixed_tiling."""
        self.size = tokens
        self.adapters = adapters
        self.meta = self._empty_meta(modules, max_rank, row_align, device, tiling)
        self._filled: tuple[LoraMeta, int] | None = None  # the step metadata the buffers hold now

    def fill(self, meta: LoraMeta, n: int) -> None:
        """Copy the metadata of a step of n tokens (n <= the graph's tokens) into the buffers."""
        if self._filled is not None and self._filled[0] is meta and self._filled[1] == n:
            return  # a decode step of the same requests reuses its predecessor's LoraMeta (decode_batch.py)
        static = self.meta
        assert static.static is not None
        tiles = static.static.tiles
        adapters = meta.ranks.shape[0]
        rows = meta.a_rows.shape[0]
        if adapters > self.adapters or rows > static.a_rows.shape[0]:
            raise ValueError(f"a step of {adapters} adapters ({rows} rows) does not fit a graph of {self.adapters} "
                             f"({static.a_rows.shape[0]} rows)")  # fmt: skip
        step_tiles = meta.tiles(static.static.tile_block)
        count = step_tiles.shape[0]
        if count > tiles.shape[0]:
            raise ValueError(f"a step of {count} LoRA tiles does not fit a graph of {tiles.shape[0]}")
        self._filled = (meta, n)
        static.ranks[:adapters].copy_(meta.ranks)
        static.scales[:adapters].copy_(meta.scales)
        static.row_start[:adapters].copy_(meta.row_start)
        static.a_rows[:rows].copy_(meta.a_rows)
        static.b_rows[:rows].copy_(meta.b_rows)
        static.token_adapter[:n].copy_(meta.token_adapter)
        static.token_adapter[n:].fill_(-1)
        tiles[:count].copy_(step_tiles)
        tiles[count:, 1:3].zero_()
        tiles[count:, 3].fill_(self.adapters)

    def _empty_meta(self, modules: frozenset[int], max_rank: int, row_align: int, device: torch.device,
                    tiling: tuple[int, str, int]) -> LoraMeta:  # fmt: skip
        tile_block, kind, max_tiles = tiling
        columns = len(LORA_MODULES)
        tiles = torch.zeros((max_tiles, TILE_COLUMNS), dtype=torch.int32, device=device)
        tiles[:, 3] = self.adapters
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
            static=StaticBounds(max_rank, tiles, tile_block, modules, kind),
        )


def decode_tiling(size: int, few_adapters: int | None) -> tuple[int, str, int]:
    """(tile_block, kind, max_tiles) of a decode graph of `size` sequences: one-token GEMV tiles, or with
    few_adapters (the most adapters of the steps it replays) 16-token tensor-core tiles: a full tile per 16 tokens
    and a partial one per adapter at most."""
    decode_block, few_block = tile_blocks()
    if few_adapters is None:
        return decode_block, "decode", size
    return few_block, "mixed", cdiv(size, few_block) + few_adapters


def mixed_tiling(tokens: int, adapters: int) -> tuple[int, str, int]:
    """(tile_block, kind, max_tiles) of a graph of steps with prompts: 16-token tensor-core tiles (the configs an
    eager step of decodes and prompts runs), a full tile per 16 tokens and a partial one per adapter at most."""
    _, few_block = tile_blocks()
    return few_block, "mixed", cdiv(tokens, few_block) + adapters
