"""The batch of a decode step built from the previous decode step's, when both run the same requests in order.

Between admissions, consecutive decode steps run the same running requests in the same order, each one token
further: positions and context lengths grow by one, a block-table row changes only when its request takes a new
page, and the LoRA segments do not change at all. build_batch redoes all of it in Python per sequence; here the
host side is a few numpy operations over the whole batch, the previous step's LoRA metadata is reused as it is,
and only the requests that took a page touch their block-table rows. On the H200 host that work sits between two
CUDA-graph replays while the GPU idles (the `build` phase of perf/RESULTS.md's step tables).

A step qualifies when every sequence computes one token and samples it, and the scheduled requests are the
previous step's, in the same order, each with exactly one more token computed. Anything else (an admission, a
finish, a preemption, a prompt chunk) builds the batch in full and starts again from it.
"""

from __future__ import annotations

import numpy as np
import torch

from slora.backend.engine.request import Request
from slora.backend.executor.batch import ForwardBatch, ScheduledSeq, adapter_order, build_batch, list_to_device
from slora.backend.executor.lora_tables import LoraTablesCache
from slora.kernels.metadata import AttentionMeta, to_device


class DecodeBatches:
    """build(): the step's ForwardBatch, incrementally from the last one when the step qualifies (see top)."""

    def __init__(self, block_size: int, device: torch.device, lora_tables: LoraTablesCache | None = None) -> None:
        self.block_size = block_size
        self.device = device
        self.lora_tables = lora_tables
        self.incremental = 0  # steps built from the previous one (tests and benchmarks read it)
        self._reset()

    def _reset(self) -> None:
        self._scheduled: list[Request] = []  # the previous step's requests, in the scheduler's order
        self._order: list[int] = []  # rows of the batch: indices into the scheduler's order (by adapter)
        self._batch: ForwardBatch | None = None
        self._positions = np.zeros(0, dtype=np.int64)
        self._tables = np.zeros((0, 0), dtype=np.int32)  # block tables, one row per batch row
        self._tables_host: list[list[int]] = []
        self._num_blocks = np.zeros(0, dtype=np.int64)  # blocks each row's table holds

    def build(self, seqs: list[ScheduledSeq], inflight: torch.Tensor | None = None) -> ForwardBatch:
        """`inflight`: the tokens the previous step sampled (one per row of its batch), when they are still on the
        device: a step built from that one takes its input tokens from them. Other builds leave in-flight
        input tokens as 0 (the caller fills them in, inflight.py)."""
        requests = [s.request for s in seqs]
        decode = all(s.num_tokens == 1 and s.request.num_computed == s.request.num_tokens - 1 for s in seqs)
        if not decode:
            self._reset()
            return build_batch(seqs, self.block_size, self.device, self.lora_tables)
        same = len(requests) == len(self._scheduled) and all(a is b for a, b in zip(requests, self._scheduled))
        if same:
            batch = self._advance(seqs, inflight)
            if batch is not None:
                self.incremental += 1
                return batch
        return self._rebuild(seqs, requests)

    def _rebuild(self, seqs: list[ScheduledSeq], requests: list[Request]) -> ForwardBatch:
        order = adapter_order(seqs)
        batch = build_batch([seqs[i] for i in order], self.block_size, self.device, self.lora_tables)
        attn = batch.attn
        self._scheduled, self._order, self._batch = requests, order, batch
        self._positions = np.array(attn.seq_lens_host, dtype=np.int64) - 1
        self._tables_host = list(attn.block_tables_host)
        self._num_blocks = np.array([len(t) for t in self._tables_host], dtype=np.int64)
        self._tables = np.zeros((len(order), int(self._num_blocks.max(initial=1))), dtype=np.int32)
        for row, table in enumerate(self._tables_host):
            self._tables[row, : len(table)] = table
        return batch

    def _advance(self, seqs: list[ScheduledSeq], inflight: torch.Tensor | None) -> ForwardBatch | None:
        """The batch one token further than the last one; None when a request did not move by exactly one."""
        previous = self._batch
        assert previous is not None
        ordered = [seqs[i] for i in self._order]
        positions = np.fromiter((s.request.num_computed for s in ordered), dtype=np.int64, count=len(ordered))
        if not np.array_equal(positions, self._positions + 1):
            return None
        bs = self.block_size
        block = positions // bs  # the block each position falls in
        blocks = block + 1
        grown = np.flatnonzero(blocks > self._num_blocks)
        if grown.size and not self._grow(ordered, grown, blocks):
            return None
        slots = self._tables[np.arange(len(ordered)), block].astype(np.int64) * bs + positions % bs
        seq_lens = positions + 1
        width = int(blocks.max())
        attn = AttentionMeta(
            q_start=previous.attn.q_start,
            seq_lens=_device(seq_lens.astype(np.int32), self.device),
            block_tables=_device(self._tables[:, :width], self.device),
            slot_mapping=_device(slots, self.device),
            block_size=bs,
            max_q_len=1,
            max_seq_len=int(seq_lens.max()),
            q_start_host=previous.attn.q_start_host,
            seq_lens_host=seq_lens.tolist(),
            block_tables_host=list(self._tables_host),
        )
        self._positions = positions
        self._batch = ForwardBatch(
            input_ids=inflight if inflight is not None else self._input_ids(ordered, positions),
            positions=_device(positions, self.device),
            attn=attn,
            lora=previous.lora,  # same requests, same adapters, same segments
            sample_index=previous.sample_index,
            seqs=ordered,
            sampled=ordered,
        )
        return self._batch

    def _input_ids(self, ordered: list[ScheduledSeq], positions: np.ndarray) -> torch.Tensor:
        ids = [s.request.token_ids[p] for s, p in zip(ordered, positions.tolist())]
        return list_to_device(ids, torch.int64, self.device)

    def _grow(self, ordered: list[ScheduledSeq], grown: np.ndarray, blocks: np.ndarray) -> bool:
        """Block-table rows of the requests that took a page; False when one lacks the page it needs."""
        width = int(blocks.max())
        if width > self._tables.shape[1]:
            wider = np.zeros((self._tables.shape[0], max(width, 2 * self._tables.shape[1])), dtype=np.int32)
            wider[:, : self._tables.shape[1]] = self._tables
            self._tables = wider
        for row in grown.tolist():
            need = int(blocks[row])
            pages = ordered[row].request.pages
            if len(pages) < need:
                return False
            self._tables_host[row] = pages[:need]
            self._tables[row, :need] = pages[:need]
            self._num_blocks[row] = need
        return True


def _device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A copy of `values` on `device` (never sharing memory with the array, which later steps update in place)."""
    return to_device(torch.from_numpy(np.array(values, copy=True)), device)
