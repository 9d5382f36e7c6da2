"""The LoRA metadata of a captured decode graph: static buffers of one bucket, refilled from each step's LoraMeta.

A graph replays the grids and buffer shapes it was captured with (kernels/metadata.StaticBounds), so a step's
LoraMeta is copied into buffers sized for the bucket (`size` sequences) and the graph's rank bound:

    adapter rows 0 .. size-1   the step's adapters (ranks, scales, row starts)
    adapter row `size`         the null adapter: rank 0, never written
    tiles                      one per LoRA tile of the step; the rest name the null adapter and cover no token
    token_adapter              the step's tokens, -1 (no adapter) for the padding rows

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
    few_adapters: None for a graph of one-token GEMV tiles, else the most adapters of the steps it replays on
    16-token tensor-core tiles."""

    def __init__(
        self,
        size: int,
        modules: frozenset[int],
        max_rank: int,
        row_align: int,
        device: torch.device,
        few_adapters: int | None = None,
    ) -> None:
        self.size = size
        self.meta = _static_meta(size, modules, max_rank, row_align, device, few_adapters)
        self._filled: tuple[LoraMeta, int] | None = None  # the step metadata the buffers hold now

    def fill(self, meta: LoraMeta, n: int) -> None:
        """Copy the metadata of a decode step of n sequences (n <= size) into the buffers."""
        if self._filled is not None and self._filled[0] is meta and self._filled[1] == n:
            return  # a decode step of the same requests reuses its predecessor's LoraMeta (decode_batch.py)
        self._filled = (meta, n)
        static = self.meta
        assert static.static is not None
        tiles = static.static.tiles
        adapters = meta.ranks.shape[0]
        rows = meta.a_rows.shape[0]
        static.ranks[:adapters].copy_(meta.ranks)
        static.scales[:adapters].copy_(meta.scales)
        static.row_start[:adapters].copy_(meta.row_start)
        static.a_rows[:rows].copy_(meta.a_rows)
        static.b_rows[:rows].copy_(meta.b_rows)
        static.token_adapter[:n].copy_(meta.token_adapter)
        static.token_adapter[n:].fill_(-1)
        step_tiles = meta.tiles(static.static.tile_block)
        count = step_tiles.shape[0]
        if count > tiles.shape[0]:
            raise ValueError(f"a step of {count} LoRA tiles does not fit a graph of {tiles.shape[0]}")
        tiles[:count].copy_(step_tiles)
        tiles[count:, 1:3].zero_()
        tiles[count:, 3].fill_(self.size)


def _static_meta(
    size: int, modules: frozenset[int], max_rank: int, row_align: int, device: torch.device, few_adapters: int | None
) -> LoraMeta:
    decode_block, few_block = tile_blocks()
    if few_adapters is None:
        tile_block, kind, max_tiles = decode_block, "decode", size
    else:  # a full tile per few_block tokens, and a partial one per adapter at most
        tile_block, kind, max_tiles = few_block, "mixed", cdiv(size, few_block) + few_adapters
    columns = len(LORA_MODULES)
    tiles = torch.zeros((max_tiles, TILE_COLUMNS), dtype=torch.int32, device=device)
    tiles[:, 3] = size
    return LoraMeta(
        token_adapter=torch.full((size,), -1, dtype=torch.int32, device=device),
        seg_start=torch.zeros(size + 1, dtype=torch.int32, device=device),
        seg_adapter=torch.zeros(size, dtype=torch.int32, device=device),
        ranks=torch.zeros((size + 1, columns), dtype=torch.int32, device=device),
        scales=torch.zeros((size + 1, columns), dtype=torch.float32, device=device),
        row_start=torch.zeros((size + 1, columns), dtype=torch.int32, device=device),
        a_rows=torch.zeros(size * columns * max_rank, dtype=torch.int64, device=device),
        b_rows=torch.zeros(size * columns * max_rank, dtype=torch.int64, device=device),
        max_rank=max_rank,
        seg_start_host=[],
        seg_adapter_host=[],
        ranks_host=[],
        scales_host=[],
        row_start_host=[],
        row_align=row_align,
        static=StaticBounds(max_rank, tiles, tile_block, modules, kind),
    )
