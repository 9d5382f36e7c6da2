"""metadata.tiles_of: the tiles every attention and LoRA kernel launches a program for, built on the host."""

from __future__ import annotations

import random

import numpy as np
import torch

from slora.kernels.metadata import tile_rows, tiles_of

CPU = torch.device("cpu")


def _runs(segments: list[tuple[int, int, int, int]], block: int) -> list[list[int]]:
    """The definition: each segment's rows in runs of up to `block`, as (segment, first row, segment end, tag)."""
    return [[g, row, end, tag] for g, start, end, tag in segments for row in range(start, end, block)]


def test_tiles_of_a_step() -> None:
    """Decodes get a tile each, a prompt one per `block` rows (the last partial), an empty segment none."""
    segments = [(0, 0, 1, 7), (1, 1, 2, 3), (2, 2, 2, 9), (3, 2, 37, 4)]
    tiles = tiles_of(segments, 16, CPU)
    assert tiles.dtype == torch.int32
    assert tiles.tolist() == [[0, 0, 1, 7], [1, 1, 2, 3], [3, 2, 37, 4], [3, 18, 37, 4], [3, 34, 37, 4]]
    assert tiles_of([], 16, CPU).shape == (0, 4)


def test_tiles_of_random_steps() -> None:
    """Any mix of empty, decode, short and long segments, at the kernels' tile sizes; a graph's host rows
    (tile_rows) are the same."""
    rng = random.Random(5)
    for _ in range(500):
        segments, row = [], 0
        for g in range(rng.randrange(0, 40)):
            length = rng.choice([0, 1, 1, 2, 15, 16, 17, 64, 65, rng.randrange(0, 300)])
            segments.append((g, row, row + length, rng.randrange(100)))
            row += length
        for block in (1, 16, 64):
            assert tiles_of(segments, block, CPU).tolist() == _runs(segments, block), (segments, block)
            host = tile_rows(np.array(segments, dtype=np.int64).reshape(-1, 4), block)
            assert host.tolist() == _runs(segments, block), (segments, block)
