"""What one step computes: the scheduler's choice (ScheduledSeq) and the tensors built from it (ForwardBatch)."""

from __future__ import annotations

import array
from dataclasses import dataclass

import numpy as np
import torch

from slora.backend.engine.request import Request
from slora.backend.executor.lora_tables import LoraTablesCache, build_tables
from slora.backend.memory.adapter_cache import ResidentAdapter
from slora.kernels.metadata import AttentionMeta, LoraMeta, to_device


@dataclass
class ScheduledSeq:
    """`num_tokens` of `request` are computed this step, starting at its position `request.num_computed`."""

    request: Request
    num_tokens: int


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    attn: AttentionMeta
    lora: LoraMeta | None  # None when no token of the step uses an adapter
    sample_index: torch.Tensor  # int64 [num_sampled]: row of each sampled sequence's last token
    seqs: list[ScheduledSeq]  # in the order of the rows (grouped by adapter)
    sampled: list[ScheduledSeq]  # the seqs that sample, in the order of sample_index

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def order_by_adapter(seqs: list[ScheduledSeq]) -> list[ScheduledSeq]:
    """Base-model sequences first, then those of each adapter together, so each adapter is one token segment."""
    return [seqs[i] for i in adapter_order(seqs)]


def adapter_order(seqs: list[ScheduledSeq]) -> list[int]:
    """The indices of `seqs` in order_by_adapter's order (stable: the scheduler's order within an adapter)."""
    return sorted(range(len(seqs)), key=lambda i: (seqs[i].request.resident is not None, _adapter_key(seqs[i].request)))


def _adapter_key(request: Request) -> tuple[str, int]:
    return request.resident.key if request.resident is not None else ("", 0)


def build_batch(
    seqs: list[ScheduledSeq], block_size: int, device: torch.device, lora_tables: LoraTablesCache | None = None
) -> ForwardBatch:
    seqs = order_by_adapter(seqs)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    q_start = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    sample_rows: list[int] = []
    sampled: list[ScheduledSeq] = []
    for s in seqs:
        r = s.request
        begin, end = r.num_computed, r.num_computed + s.num_tokens
        if s.num_tokens == 1:  # a decode: most sequences of most steps
            # a token still in flight (sampled by the step before, not yet read back) comes from the device later
            input_ids.append(r.token_ids[begin] if begin < len(r.token_ids) else 0)
            positions.append(begin)
            slots.append(r.pages[begin // block_size] * block_size + begin % block_size)
        else:
            input_ids += r.token_ids[begin:end]
            positions += range(begin, end)
            slots += [r.pages[p // block_size] * block_size + p % block_size for p in range(begin, end)]
        q_start.append(q_start[-1] + s.num_tokens)
        seq_lens.append(end)
        tables.append(r.pages[: -(-end // block_size)])
        if end == r.num_tokens:  # the step reaches the last token: its logits are sampled
            sample_rows.append(q_start[-1] - 1)
            sampled.append(s)
    width = max(len(t) for t in tables)
    attn = AttentionMeta(
        q_start=list_to_device(q_start, torch.int32, device),
        seq_lens=list_to_device(seq_lens, torch.int32, device),
        block_tables=list_to_device([t + [0] * (width - len(t)) for t in tables], torch.int32, device),
        slot_mapping=list_to_device(slots, torch.int64, device),
        block_size=block_size,
        max_q_len=max(s.num_tokens for s in seqs),
        max_seq_len=max(seq_lens),
        q_start_host=q_start,
        seq_lens_host=seq_lens,
        block_tables_host=tables,
    )
    return ForwardBatch(
        input_ids=list_to_device(input_ids, torch.int64, device),
        positions=list_to_device(positions, torch.int64, device),
        attn=attn,
        lora=build_lora_meta(seqs, q_start, device, lora_tables),
        sample_index=list_to_device(sample_rows, torch.int64, device),
        seqs=seqs,
        sampled=sampled,
    )


def build_lora_meta(
    seqs: list[ScheduledSeq], q_start: list[int], device: torch.device, tables: LoraTablesCache | None = None
) -> LoraMeta | None:
    """Segments of tokens per adapter (seqs are already grouped by adapter) and each adapter's row table (from
    `tables` when the step's adapters are the previous step's)."""
    adapters, token_adapter, seg_start, seg_adapter = _segments(seqs, q_start)
    if not adapters:
        return None
    t = tables.get(adapters, device) if tables is not None else build_tables(adapters, device)
    return LoraMeta(
        token_adapter=list_to_device(token_adapter, torch.int32, device),
        seg_start=list_to_device(seg_start, torch.int32, device),
        seg_adapter=list_to_device(seg_adapter, torch.int32, device),
        ranks=t.ranks,
        scales=t.scales,
        row_start=t.row_start,
        a_rows=t.a_rows,
        b_rows=t.b_rows,
        max_rank=t.max_rank,
        seg_start_host=seg_start,
        seg_adapter_host=seg_adapter,
        ranks_host=t.ranks_host,
        scales_host=t.scales_host,
        row_start_host=t.row_start_host,
        row_align=t.row_align,
    )


def _segments(
    seqs: list[ScheduledSeq], q_start: list[int]
) -> tuple[list[ResidentAdapter], list[int], list[int], list[int]]:
    """(active adapters, adapter index of each token (-1: none), segment starts, adapter of each segment)."""
    adapters: list[ResidentAdapter] = []
    index: dict[tuple[str, int], int] = {}
    token_adapter: list[int] = []
    seg_start: list[int] = []
    seg_adapter: list[int] = []
    for i, s in enumerate(seqs):
        resident = s.request.resident
        slot = -1
        if resident is not None:
            if resident.key not in index:
                index[resident.key] = len(adapters)
                adapters.append(resident)
                seg_start.append(q_start[i])
                seg_adapter.append(index[resident.key])
            slot = index[resident.key]
        token_adapter += [slot] * s.num_tokens
    seg_start.append(q_start[-1])  # adapter sequences come last (order_by_adapter): the last segment ends the batch
    return adapters, token_adapter, seg_start, seg_adapter


_ARRAY_CODES = {torch.int32: "i", torch.int64: "q", torch.float32: "f"}
_NUMPY_TYPES = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}


def list_to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`: through array/numpy, which convert Python ints several times faster
    than torch.tensor (this runs for about a dozen lists per step, some of thousands of entries)."""
    if not values:
        return to_device(torch.tensor(values, dtype=dtype), device)
    if isinstance(values[0], list):
        host = torch.from_numpy(np.array(values, dtype=_NUMPY_TYPES[dtype]))
    else:
        host = torch.frombuffer(array.array(_ARRAY_CODES[dtype], values), dtype=dtype)
    return to_device(host, device)
