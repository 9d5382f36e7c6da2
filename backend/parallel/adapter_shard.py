"""One rank's share of a LoRA adapter under S-LoRA's tensor-parallel partition (paper §6), as pool pages.

The adapter follows the base weights' partition (layout.py), so no weight moves between devices and each step
adds only r numbers per token to the communication. For rank i of n, with lora_A's rows A[k] (width in) and
lora_Bᵀ's rows Bᵀ[k] (width out) of a projection of rank r::

  column-parallel projection (q, k, v, gate, up: the base weight's output features are split)
    A rows   padded rows i, i+n, i+2n, ... of A            ⌈r/n⌉ rows, width in (zero rows pad r to P = n·⌈r/n⌉)
    Bᵀ rows  all P rows, rank i's output columns            P rows, width out/n
    x ─► x·Aᵢᵀ [T, P/n] ─all-gather─► x·Aᵀ [T, P] ─► ·Bᵢᵀ·scale ─► y[:, rank i's columns]     (nothing more)

  row-parallel projection (o, down: the input features are split, and so is x)
    A rows   all r rows, rank i's input columns             r rows, width in/n
    Bᵀ rows  all r rows, hidden columns i·h/n .. (i+1)·h/n  r rows, width h/n
    xᵢ ─► xᵢ·Aᵢᵀ [T, r] (partial) ─all-reduce─► x·Aᵀ [T, r] ─► ·Bᵢᵀ·scale ─► yᵢ[:, i·h/n .. (i+1)·h/n]
          yᵢ is the base projection's partial sum: its all-reduce (one, as without adapters) adds every rank's
          slice of the LoRA output to the base output.

    gathered x·Aᵢᵀ, [n, T, P/n] ──permute──► [T, P/n, n]: column k·n + j is padded row k·n + j of x·Aᵀ,
    so the strided split of A puts the gathered columns in A's own row order, the order of the Bᵀ rows.

A rank's rows are laid out as one device's (host_adapter.py: rows grouped by width, page after page), in pages of
the rank's pool (page_pool.py: a page is 1/n of one device's when the KV heads are split). Every rank's share of
an adapter has the same rows and widths, so the same number of pages: the pages rank 0 allocates hold each rank's
share at the same indices. Its LoRA tables (lora.py) give the shrink ⌈r/n⌉ (column) or r (row) rows per
module, the expand P or r.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from slora.backend.adapters.host_adapter import (
    _KEY,
    MAX_RANK,
    WEIGHTS_FILE,
    HostAdapter,
    _collect,
    _fill_image,
    _read_config,
    _read_tensors,
    _reference_scale,
    _row_offsets,
    _RowGroup,
)
from slora.backend.errors import AdapterError
from slora.backend.memory.page_pool import PoolGeometry
from slora.backend.model.spec import LORA_MODULES
from slora.backend.parallel.layout import COLUMN_PARALLEL, ShardPlan

Fingerprint = tuple[int, int]  # (bytes, mtime in ns) of the weights file a shard was read from


@dataclass
class ShardedHostAdapter(HostAdapter):
    """A HostAdapter holding one rank's rows (see top). `ranks` and `scales` stay the whole adapter's (listings,
    CUDA-graph families); `shrink_rows` / `expand_rows` are this rank's A / Bᵀ rows per module."""

    shrink_rows: tuple[int, ...] = ()
    expand_rows: tuple[int, ...] = ()
    fingerprint: Fingerprint = (0, 0)


def shard_rows(module: str, rank: int, size: int) -> tuple[int, int]:
    """(A rows, Bᵀ rows) a rank holds of a projection of rank `rank` over `size` ranks (see top)."""
    if not rank:
        return 0, 0
    if module in COLUMN_PARALLEL:
        per_rank = -(-rank // size)
        return per_rank, per_rank * size
    return rank, rank


def weights_fingerprint(path: Path) -> Fingerprint:
    """What says that two ranks read the same weights file (an adapter rewritten in place between them is not)."""
    stat = os.stat(path / WEIGHTS_FILE)
    return stat.st_size, stat.st_mtime_ns


def load_adapter_shard(
    name: str,
    path: str | Path,
    plan: ShardPlan,
    geometry: PoolGeometry,
    dtype: torch.dtype,
    pin_memory: bool = False,
    max_rank: int = MAX_RANK,
    generation: int = 0,
) -> ShardedHostAdapter:
    """Read and check a PEFT LoRA directory as load_peft_adapter does (the same errors), then keep rank
    plan.rank's rows (see top). `geometry` is the rank's pool's."""
    path = Path(path)
    spec = plan.spec
    config = _read_config(name, path)
    tensors = _read_tensors(name, path, spec, max_rank)
    per_module = _collect(name, path, tensors, config, spec)
    ranks = tuple(max((r for r, _ in per_module[m].values()), default=0) for m in LORA_MODULES)
    scales = tuple(_reference_scale(per_module[m]) for m in LORA_MODULES)
    rows = [shard_rows(m, r, plan.size) for m, r in zip(LORA_MODULES, ranks)]
    groups = _layout(rows, _widths(plan), geometry)
    image = torch.zeros((spec.num_layers, sum(g.num_pages for g in groups), geometry.page_elems), dtype=dtype)
    shards = {key: _shard(key, tensor, plan, ranks) for key, tensor in tensors.items()}
    try:
        _fill_image(image, groups, shards, per_module, scales)
    except AdapterError as exc:
        raise AdapterError(f"adapter {name!r}: {path / WEIGHTS_FILE}: {exc}") from exc
    a_local, b_local = _row_offsets(groups, ranks, geometry.page_elems)
    return ShardedHostAdapter(
        name=name,
        path=path,
        ranks=ranks,
        scales=scales,
        image=image.pin_memory() if pin_memory else image,
        a_local=a_local,
        b_local=b_local,
        generation=generation,
        shrink_rows=tuple(a for a, _ in rows),
        expand_rows=tuple(b for _, b in rows),
        fingerprint=weights_fingerprint(path),
    )


def _widths(plan: ShardPlan) -> list[tuple[int, int]]:
    """(A row width, Bᵀ row width) of each module on a rank (see top)."""
    widths = []
    for module in LORA_MODULES:
        in_features, _ = plan.spec.module_shape(module)
        if module in COLUMN_PARALLEL:
            start, end = plan.out_range(module)
            widths.append((in_features, end - start))
        else:
            start, end = plan.in_range(module)
            widths.append((end - start, plan.hidden))
    return widths


def _layout(rows: list[tuple[int, int]], widths: list[tuple[int, int]], geometry: PoolGeometry) -> list[_RowGroup]:
    """Rows grouped by width, as host_adapter._layout, with each side's own row count."""
    blocks: dict[int, list[tuple[int, str, int]]] = {}
    for m, ((a_rows, b_rows), (a_width, b_width)) in enumerate(zip(rows, widths)):
        if a_rows:
            blocks.setdefault(a_width, []).append((m, "A", a_rows))
            blocks.setdefault(b_width, []).append((m, "B", b_rows))
    groups, first_page = [], 0
    for width, group_blocks in sorted(blocks.items()):
        group = _RowGroup(width, geometry.rows_per_page(width), first_page, tuple(group_blocks))
        groups.append(group)
        first_page += group.num_pages
    return groups


def _shard(key: str, tensor: torch.Tensor, plan: ShardPlan, ranks: tuple[int, ...]) -> torch.Tensor:
    """The rank's part of one PEFT tensor, in PEFT's orientation (lora_A [rows, in], lora_B [out, rows]), its rank
    first padded with zero rows to the module's (rank_pattern) and, for column-parallel modules, to a multiple of n."""
    match = _KEY.match(key)
    assert match is not None  # _read_tensors checked every key
    module, side = match[3], match[4]
    a_rows, b_rows = shard_rows(module, ranks[LORA_MODULES.index(module)], plan.size)
    rows = tensor if side == "A" else tensor.t()  # [rank, width]: A, or Bᵀ
    rows = F.pad(rows, (0, 0, 0, b_rows - rows.shape[0]))  # zero rows up to P (column) or the module's rank (row)
    if module in COLUMN_PARALLEL:
        if side == "A":
            return rows[plan.rank :: plan.size].contiguous()  # [P/n, in]: the strided split (see top)
        start, end = plan.out_range(module)
        return rows[:, start:end].t().contiguous()  # lora_B shape [out/n, P]
    if side == "A":
        start, end = plan.in_range(module)
        return rows[:, start:end].contiguous()  # [r, in/n]
    start, end = plan.hidden_range()
    return rows[:, start:end].t().contiguous()  # lora_B shape [h/n, r]
