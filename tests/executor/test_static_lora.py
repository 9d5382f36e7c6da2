"""The static LoRA buffers of a graph of steps with prompts: the tiles of each launch group are an eager step's."""

from __future__ import annotations

import random

import pytest
import torch

from slora.backend.executor.static_lora import StaticLora, Tiling, mixed_tiling
from slora.kernels.metadata import SHORT_SEGMENT, length_groups, tiles_of

CPU = torch.device("cpu")
NULL = 6  # the graph's adapter bound: the null adapter's row


def _static(short_rows: int, long_rows: int, long_block: int = 64) -> StaticLora:
    tilings = [Tiling(SHORT_SEGMENT, "short", short_rows), Tiling(long_block, "prompts", long_rows)]
    return StaticLora(64, NULL, frozenset({0, 1, 2, 3}), 8, 1, CPU, tilings)


def _eager(seg_start: list[int], seg_adapter: list[int], blocks: tuple[int, int]) -> list[list[list[int]]]:
    """The tiles an eager step launches, group by group (short segments first), with lora_split."""
    segments = [(g, seg_start[g], seg_start[g + 1], a) for g, a in enumerate(seg_adapter)]
    groups = length_groups(segments, CPU, split=True)
    by_kind: dict[bool, list[list[int]]] = {True: [], False: []}
    for group in groups:
        short = all(end - start <= SHORT_SEGMENT for _, start, end, _ in group.segments)
        by_kind[short] = tiles_of(group.segments, blocks[0] if short else blocks[1], CPU).tolist()
    return [by_kind[True], by_kind[False]]


def test_split_tiles_are_the_eager_groups_tiles() -> None:
    """Decodes (one token), a short chunk (16 tokens: still short), prompts of 17 and 150 tokens: a tile for each
    short segment, 64-token tiles for the long ones, in segment order; the rest of each group's rows name the null
    adapter and cover no token."""
    seg_start = [0, 1, 2, 18, 35, 185, 186]
    seg_adapter = [4, 0, 5, 1, 2, 3]
    static = _static(short_rows=5, long_rows=6)
    rows = static.split_tiles(seg_start, seg_adapter).tolist()
    short, long = rows[:5], rows[5:]
    want_short, want_long = _eager(seg_start, seg_adapter, (SHORT_SEGMENT, 64))
    assert want_short == [[0, 0, 1, 4], [1, 1, 2, 0], [2, 2, 18, 5], [5, 185, 186, 3]]
    assert want_long == [[3, 18, 35, 1], [4, 35, 185, 2], [4, 99, 185, 2], [4, 163, 185, 2]]
    assert short == want_short + [[0, 0, 0, NULL]]
    assert long == want_long + [[0, 0, 0, NULL]] * 2


def test_split_tiles_refuse_a_step_beyond_the_graph() -> None:
    """More tiles than a group's rows is an error naming both counts, not a silent cut."""
    static = _static(short_rows=2, long_rows=4)
    with pytest.raises(ValueError, match="3 LoRA tiles of 16 tokens does not fit the graph's 2"):
        static.split_tiles([0, 1, 2, 3], [0, 1, 2])
    with pytest.raises(ValueError, match="5 LoRA tiles of 64 tokens does not fit the graph's 4"):
        static.split_tiles([0, 300], [0])


def test_mixed_tiling_bounds_every_step_of_its_bucket() -> None:
    """Any split of a bucket's tokens into at most its adapters' segments (an adapter's decodes and prompts are one
    segment) fits the split tiling's rows, the prompt group's K split planned for its full tiles; a graph for
    steps of few adapters has the prompt group alone; without the split, one group of 16-token tiles."""
    rng = random.Random(7)
    for _ in range(300):
        tokens, adapters = rng.choice([(64, 16), (384, 64), (1024, 512), (1024, 16), (32, 32)])
        lengths = [rng.choice([1, 1, 2, 16, 17, 64, 65, rng.randrange(1, 400)]) for _ in range(adapters)]
        while sum(lengths) > tokens:
            lengths.pop()
        tilings = mixed_tiling(tokens, adapters, split=True)
        assert [t.kind for t in tilings] == ["short", "prompts"]
        assert tilings[0].max_tiles == min(tokens, adapters) and tilings[1].grid_tiles == -(-tokens // 64)
        static = StaticLora(tokens, adapters, frozenset({0}), 8, 1, CPU, tilings)
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        rows = static.split_tiles(starts, list(range(len(lengths))))
        assert rows.shape[0] == sum(t.max_tiles for t in tilings)
    (one,) = mixed_tiling(1024, 512, split=False)
    assert one.kind == "mixed" and one.block == 16 and one.max_tiles == 64 + 512
    (few,) = mixed_tiling(1024, 512, split=True, few_adapters=8)
    assert few == Tiling(64, "prompts", 16 + 8, 16)
