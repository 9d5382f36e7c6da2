"""The per-adapter tables of a step's LoRA metadata (ranks, scales, row starts, pool row offsets), kept while the
step's adapters stay the same.

Consecutive decode steps run the same requests, so the same adapters in the same order, until one finishes or
joins: their tables (and the copies of them to the GPU) need not be rebuilt. Only the token segments change with
the step. The cache holds the adapters it was built for, so an adapter copied elsewhere in the pool (a new
ResidentAdapter) never matches an old entry.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import numpy as np
import torch

from slora.backend.memory.adapter_cache import ResidentAdapter
from slora.kernels.metadata import alignment_of, to_device


@dataclass(frozen=True)
class LoraTables:
    ranks: torch.Tensor  # int32 [num_adapters, 7], on the device
    scales: torch.Tensor  # float32 [num_adapters, 7]
    row_start: torch.Tensor  # int32 [num_adapters, 7]: first entry of each (adapter, module) in a_rows / b_rows
    a_rows: torch.Tensor  # int64 [total_rows]
    b_rows: torch.Tensor  # int64 [total_rows]
    max_rank: int
    ranks_host: list[list[int]]
    scales_host: list[list[float]]
    row_start_host: list[list[int]]
    row_align: int


def build_tables(adapters: list[ResidentAdapter], device: torch.device) -> LoraTables:
    """The tables of `adapters` in this order, from what each ResidentAdapter holds ready (numpy arrays: this runs
    whenever a step's adapter list changes, for up to max_num_seqs adapters)."""
    ranks = np.concatenate([a.ranks for a in adapters]).reshape(len(adapters), -1)  # [num_adapters, 7]
    scales = np.concatenate([a.scales for a in adapters]).reshape(ranks.shape)
    flat = ranks.ravel()
    # Start of each (adapter, module) in the concatenated row tables: adapters, then modules, in order.
    row_start = (np.cumsum(flat, dtype=np.int32) - flat).reshape(ranks.shape)
    a_rows = np.concatenate([a.a_rows for a in adapters])
    b_rows = np.concatenate([a.b_rows for a in adapters])
    return LoraTables(
        ranks=to_device(torch.from_numpy(ranks), device),
        scales=to_device(torch.from_numpy(scales), device),
        row_start=to_device(torch.from_numpy(row_start), device),
        a_rows=to_device(torch.from_numpy(a_rows), device),
        b_rows=to_device(torch.from_numpy(b_rows), device),
        max_rank=int(ranks.max()),
        ranks_host=ranks.tolist(),
        scales_host=[list(a.host.scales) for a in adapters],
        row_start_host=row_start.tolist(),
        row_align=alignment_of(functools.reduce(operator.or_, (a.rows_or for a in adapters), 0)),
    )


class LoraTablesCache:
    """The tables of the last adapter list asked for, rebuilt when the list changes (see top)."""

    def __init__(self) -> None:
        self._adapters: list[ResidentAdapter] = []
        self._device: torch.device | None = None
        self._tables: LoraTables | None = None
        self.hits = 0
        self.builds = 0  # the lists that were not the last one: tables built and copied to the device

    def get(self, adapters: list[ResidentAdapter], device: torch.device) -> LoraTables:
        # The device as asked for, not the tables' own: a tensor on torch.device("cuda") reports "cuda:0", which
        # never equals the unindexed device the engine passes.
        same = len(adapters) == len(self._adapters) and all(a is b for a, b in zip(adapters, self._adapters))
        if same and self._tables is not None and self._device == device:
            self.hits += 1
            return self._tables
        self._adapters = list(adapters)
        self._device = device
        self._tables = build_tables(adapters, device)
        self.builds += 1
        return self._tables
