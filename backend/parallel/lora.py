"""Heterogeneous LoRA under S-LoRA's tensor-parallel partition: shrink, one small collective, expand.

adapter_shard.py draws which rows each rank holds. Per call site (q/k/v, o, gate/up, down) of a layer:

    column-parallel (q/k/v, gate/up):  h = x·Aᵢᵀ [T, R/n] ─all-gather─► [T, R] ─expand─► y[:, own columns]
    row-parallel (o, down):            h = xᵢ·Aᵢᵀ [T, r] ─all-reduce─► [T, r] ─expand─► y[:, i·h/n ..] (partial sum)

Only the rows of adapter tokens take part in the collectives: base-model tokens come first in the batch
(batch.order_by_adapter), so those are rows first_row .. T - 1. h is float32, as the kernels' partial sums.

Each step has two LoraMeta: `shrink` (ranks = each rank's A rows per module, a_rows) and `expand` (ranks = Bᵀ rows,
b_rows); both come from ShardRows, what one resident adapter holds on this rank. The shrink and expand steps are
the torch references (any device) or the Triton kernels (kernels/triton/lora_shrink.py, lora_expand.py), launched
as TritonOps.lora does: built by the first layer of the step, replayed by the others.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from slora.backend.executor.batch import list_to_device
from slora.backend.parallel.adapter_shard import ShardedHostAdapter
from slora.backend.parallel.collectives import Collectives
from slora.backend.parallel.layout import ShardPlan
from slora.kernels.metadata import LoraMeta, alignment_of, offsets_or, to_device
from slora.kernels.reference.lora import gather_rows
from slora.kernels.settings import KernelSettings

AdapterKey = tuple[str, int]
LORA_ALL_GATHER = "lora all-gather"  # the collectives' labels (collectives.CollectiveTimer)
LORA_ALL_REDUCE = "lora all-reduce"


@dataclass(frozen=True)
class ShardRows:
    """What a step's LoRA tables need of one adapter resident on this rank."""

    key: AdapterKey
    a_rows: np.ndarray  # int64 [Σ shrink_ranks]: flat pool-layer offset of each of this rank's lora_A rows
    b_rows: np.ndarray  # int64 [Σ expand_ranks]: the same for lora_Bᵀ rows
    shrink_ranks: np.ndarray  # int32 [7]: A rows per module on this rank
    expand_ranks: np.ndarray  # int32 [7]: Bᵀ rows per module
    scales: tuple[float, ...]  # [7]

    @classmethod
    def of(cls, host: ShardedHostAdapter, a_rows: np.ndarray, b_rows: np.ndarray) -> ShardRows:
        """An adapter's rows in the pool: a_rows / b_rows as AdapterCache places host.a_local / b_local."""
        return cls(
            key=host.key,
            a_rows=np.asarray(a_rows, dtype=np.int64),
            b_rows=np.asarray(b_rows, dtype=np.int64),
            shrink_ranks=np.array(host.shrink_rows, dtype=np.int32),
            expand_ranks=np.array(host.expand_rows, dtype=np.int32),
            scales=tuple(host.scales),
        )


@dataclass
class ShardedLoraMeta:
    """A step's LoRA metadata on one rank (see top)."""

    shrink: LoraMeta
    expand: LoraMeta
    first_row: int  # the first adapter token's row: rows before it are base-model tokens
    launches: dict[object, Any] = field(default_factory=dict, repr=False)  # per call site, built by layer 0


@dataclass(frozen=True)
class _SideTables:
    ranks: torch.Tensor
    row_start: torch.Tensor
    rows: torch.Tensor
    max_rank: int
    ranks_host: list[list[int]]
    row_start_host: list[list[int]]
    row_align: int


def _side_tables(ranks: list[np.ndarray], rows: list[np.ndarray], device: torch.device) -> _SideTables:
    table = np.stack(ranks).astype(np.int32)  # [num_adapters, 7]
    flat = table.ravel()
    row_start = (np.cumsum(flat, dtype=np.int32) - flat).reshape(table.shape)
    every = np.concatenate(rows).astype(np.int64)
    return _SideTables(
        ranks=to_device(torch.from_numpy(table), device),
        row_start=to_device(torch.from_numpy(row_start), device),
        rows=to_device(torch.from_numpy(every), device),
        max_rank=int(table.max()),
        ranks_host=table.tolist(),
        row_start_host=row_start.tolist(),
        row_align=alignment_of(functools.reduce(operator.or_, (offsets_or(r) for r in rows), 0)),
    )


class ShardedTablesCache:
    """The tables of the last adapter list asked for (consecutive decode steps run the same adapters)."""

    def __init__(self) -> None:
        self._adapters: list[ShardRows] = []
        self._tables: tuple[_SideTables, _SideTables, torch.Tensor, list[list[float]]] | None = None

    def get(
        self, adapters: list[ShardRows], device: torch.device
    ) -> tuple[_SideTables, _SideTables, torch.Tensor, list[list[float]]]:
        same = len(adapters) == len(self._adapters) and all(a is b for a, b in zip(adapters, self._adapters))
        if not same or self._tables is None:
            shrink = _side_tables([a.shrink_ranks for a in adapters], [a.a_rows for a in adapters], device)
            expand = _side_tables([a.expand_ranks for a in adapters], [a.b_rows for a in adapters], device)
            scales_host = [list(a.scales) for a in adapters]
            scales = to_device(torch.tensor(scales_host, dtype=torch.float32), device)
            self._adapters, self._tables = list(adapters), (shrink, expand, scales, scales_host)
        return self._tables


def build_sharded_meta(
    seg_start: list[int],
    seg_adapter: list[int],
    adapters: list[ShardRows],
    device: torch.device,
    cache: ShardedTablesCache,
) -> ShardedLoraMeta | None:
    """The step's metadata from its adapter segments (batch.LoraMeta's) and the rank's rows of each adapter."""
    if not seg_adapter:
        return None
    shrink_t, expand_t, scales, scales_host = cache.get(adapters, device)
    token_adapter = [-1] * seg_start[0]
    for g, a in enumerate(seg_adapter):
        token_adapter += [a] * (seg_start[g + 1] - seg_start[g])
    common = dict(
        token_adapter=list_to_device(token_adapter, torch.int32, device),
        seg_start=list_to_device(seg_start, torch.int32, device),
        seg_adapter=list_to_device(seg_adapter, torch.int32, device),
        scales=scales,
        seg_start_host=seg_start,
        seg_adapter_host=seg_adapter,
        scales_host=scales_host,
    )
    return ShardedLoraMeta(_meta(shrink_t, common), _meta(expand_t, common), first_row=seg_start[0])


def _meta(side: _SideTables, common: dict[str, Any]) -> LoraMeta:
    # One side's rows serve as both a_rows and b_rows: the shrink reads only a_rows, the expand only b_rows.
    return LoraMeta(
        ranks=side.ranks,
        row_start=side.row_start,
        a_rows=side.rows,
        b_rows=side.rows,
        max_rank=side.max_rank,
        ranks_host=side.ranks_host,
        row_start_host=side.row_start_host,
        row_align=side.row_align,
        **common,
    )


class LoraSteps(Protocol):
    def shrink(
        self, x: torch.Tensor, flat: torch.Tensor, meta: LoraMeta, first: int, num: int, site: dict[object, Any]
    ) -> torch.Tensor:
        """h = x·Aᵀ of modules first .. first + num - 1 for every adapter token: float32 [T, ≥ fused rank]."""
        ...

    def expand(
        self,
        y: torch.Tensor,
        h: torch.Tensor,
        flat: torch.Tensor,
        meta: LoraMeta,
        first: int,
        offsets: tuple[int, ...],
        widths: tuple[int, ...],
        site: dict[object, Any],
    ) -> None:
        """y[:, offset_m : offset_m + width_m] += h_m·Bᵀ_m·scale_m for every adapter token (h from shrink's layout)."""
        ...


class TorchLoraSteps:
    """The plain-torch steps (gather the rows, matmul), the reference for the Triton ones."""

    def shrink(
        self, x: torch.Tensor, flat: torch.Tensor, meta: LoraMeta, first: int, num: int, site: dict[object, Any]
    ) -> torch.Tensor:
        h = torch.zeros((x.shape[0], max(meta.fused_rank(first, num), 1)), dtype=torch.float32, device=x.device)
        for g, a in enumerate(meta.seg_adapter_host):
            start, end = meta.seg_start_host[g], meta.seg_start_host[g + 1]
            rank = sum(meta.ranks_host[a][first : first + num])
            if rank:
                row0 = meta.row_start_host[a][first]
                lora_a = gather_rows(flat, meta.a_rows[row0 : row0 + rank], x.shape[1])  # [rank, in]
                h[start:end, :rank] = x[start:end].float() @ lora_a.float().t()
        return h

    def expand(
        self,
        y: torch.Tensor,
        h: torch.Tensor,
        flat: torch.Tensor,
        meta: LoraMeta,
        first: int,
        offsets: tuple[int, ...],
        widths: tuple[int, ...],
        site: dict[object, Any],
    ) -> None:
        for g, a in enumerate(meta.seg_adapter_host):
            start, end = meta.seg_start_host[g], meta.seg_start_host[g + 1]
            column = 0
            for m, offset, width in zip(range(first, first + len(widths)), offsets, widths):
                rank = meta.ranks_host[a][m]
                if rank:
                    row0 = meta.row_start_host[a][m]
                    lora_b = gather_rows(flat, meta.b_rows[row0 : row0 + rank], width).float()  # [rank, width]
                    delta = h[start:end, column : column + rank] @ lora_b * meta.scales_host[a][m]
                    y[start:end, offset : offset + width] += delta.to(y.dtype)
                column += rank


class TritonLoraSteps:
    """The Triton shrink and expand kernels; each call site's launches (and h) are built once per step."""

    def __init__(self, settings: KernelSettings) -> None:
        self.settings = settings

    def shrink(
        self, x: torch.Tensor, flat: torch.Tensor, meta: LoraMeta, first: int, num: int, site: dict[object, Any]
    ) -> torch.Tensor:
        from slora.kernels.triton.lora_shrink import shrink_launch

        if "shrink" not in site:
            v, launch = shrink_launch(x, flat, meta, first, num, settings=self.settings)
            # The GEMV shrink leaves K-split partials; the collective needs their sum, in a buffer every layer reuses.
            h = v[0] if v.shape[0] == 1 else torch.empty(v.shape[1:], dtype=v.dtype, device=v.device)
            site["shrink"] = (v, launch, h)
        v, launch, h = site["shrink"]
        if launch is not None:
            launch(x, flat)
        if v.shape[0] > 1:
            torch.sum(v, dim=0, out=h)
        return h

    def expand(
        self,
        y: torch.Tensor,
        h: torch.Tensor,
        flat: torch.Tensor,
        meta: LoraMeta,
        first: int,
        offsets: tuple[int, ...],
        widths: tuple[int, ...],
        site: dict[object, Any],
    ) -> None:
        from slora.kernels.triton.lora_expand import expand_launch

        if "expand" not in site:  # h is the same tensor for every layer of the step (see shrink, ShardedLora)
            v = h.unsqueeze(0)  # [1, T, R]: one split, as the tensor-core shrink leaves it
            site["expand"] = expand_launch(y, v, flat, meta, first, offsets, widths, settings=self.settings)
        launch = site["expand"]
        if launch is not None:
            launch(flat, y)


def lora_steps(ops_name: str, settings: KernelSettings) -> LoraSteps:
    """The steps that match the model's ops: the Triton kernels with the Triton ops, else the torch references."""
    return TritonLoraSteps(settings) if ops_name == "triton" else TorchLoraSteps()


class ShardedLora:
    """One rank's LoRA calls: column- and row-parallel (see top)."""

    def __init__(self, steps: LoraSteps, comm: Collectives, plan: ShardPlan) -> None:
        self.steps = steps
        self.comm = comm
        self.plan = plan

    def column(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        flat: torch.Tensor,
        meta: ShardedLoraMeta,
        modules: tuple[int, ...],
        offsets: tuple[int, ...],
        widths: tuple[int, ...],
    ) -> None:
        """y[:, offsets] += x·A·B·scale of consecutive column-parallel modules (y: this rank's output columns)."""
        first, num = modules[0], len(modules)
        if meta.shrink.fused_rank(first, num) == 0:  # the same on every rank: none skips a collective alone
            return
        site = meta.launches.setdefault(("column", modules, tuple(x.shape), tuple(y.shape)), {})
        h = self.steps.shrink(x, flat, meta.shrink, first, num, site)  # [T, R/n] float32
        start, tokens, local = meta.first_row, h.shape[0], h.shape[1]
        if "gathered" not in site:
            site["gathered"] = h.new_empty((self.comm.size, tokens - start, local))
            site["full"] = h.new_empty((tokens, local * self.comm.size))
        gathered, full = site["gathered"], site["full"]
        self.comm.all_gather(h[start:], out=gathered, label=LORA_ALL_GATHER)  # [n, T_a, R/n]
        # column k·n + j of the full h is rank j's k-th row: padded row k·n + j of A (adapter_shard.py)
        full[start:].view(tokens - start, local, self.comm.size).copy_(gathered.permute(1, 2, 0))
        self.steps.expand(y, full, flat, meta.expand, first, offsets, widths, site)

    def row(self, y: torch.Tensor, x: torch.Tensor, flat: torch.Tensor, meta: ShardedLoraMeta, module: int) -> None:
        """Add x·A·B·scale of a row-parallel module to this rank's slice of the partial sum y [T, hidden]."""
        if meta.shrink.fused_rank(module, 1) == 0:
            return
        site = meta.launches.setdefault(("row", module, tuple(x.shape), tuple(y.shape)), {})
        h = self.steps.shrink(x, flat, meta.shrink, module, 1, site)  # [T, r] float32, this rank's partial sums
        self.comm.all_reduce(h[meta.first_row :], label=LORA_ALL_REDUCE)
        start, _ = self.plan.hidden_range()
        self.steps.expand(y, h, flat, meta.expand, module, (start,), (self.plan.hidden,), site)
