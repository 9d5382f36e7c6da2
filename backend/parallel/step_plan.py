"""A step as rank 0 tells it to the followers (StepPlan), and the ForwardBatch each follower builds from it.

Rank 0 builds its ForwardBatch as with one device (executor/batch.py, decode_batch.py); the plan carries its host
lists, less what follows from them (positions and KV slots from the context lengths and block tables). The input
tokens are broadcast as a tensor instead: with overlapped steps some are still being sampled on rank 0's device.
"""

from __future__ import annotations

import torch

from slora.backend.executor.batch import ForwardBatch, list_to_device
from slora.backend.parallel.messages import AdapterKey, StepPlan
from slora.kernels.metadata import AttentionMeta


def plan_of(batch: ForwardBatch, adapters: list[AdapterKey]) -> StepPlan:
    """The plan of rank 0's batch; `adapters`: its adapters in the LoRA segments' numbering (adapters_of)."""
    attn = batch.attn
    rows = {id(s): i for i, s in enumerate(batch.seqs)}
    sample_rows = [attn.q_start_host[rows[id(s)] + 1] - 1 for s in batch.sampled]  # the order of sample_index
    lora = batch.lora
    return StepPlan(
        q_start=list(attn.q_start_host),
        seq_lens=list(attn.seq_lens_host),
        block_tables=[list(t) for t in attn.block_tables_host],
        sample_rows=sample_rows,
        seg_start=list(lora.seg_start_host) if lora is not None else [],
        seg_adapter=list(lora.seg_adapter_host) if lora is not None else [],
        adapters=adapters,
    )


def adapters_of(batch: ForwardBatch) -> list[AdapterKey]:
    """The batch's adapters in order of first use: the numbering of its LoRA segments (batch._segments)."""
    keys: dict[AdapterKey, None] = {}
    for s in batch.seqs:
        if s.request.resident is not None:
            keys.setdefault(s.request.resident.key, None)
    return list(keys)


def batch_of(plan: StepPlan, block_size: int, device: torch.device) -> ForwardBatch:
    """A follower's batch for `plan`; its input_ids are to be filled by the broadcast from rank 0."""
    positions: list[int] = []
    slots: list[int] = []
    for i, table in enumerate(plan.block_tables):
        end = plan.seq_lens[i]
        begin = end - (plan.q_start[i + 1] - plan.q_start[i])
        positions += range(begin, end)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(begin, end)]
    width = max(len(t) for t in plan.block_tables)
    attn = AttentionMeta(
        q_start=list_to_device(plan.q_start, torch.int32, device),
        seq_lens=list_to_device(plan.seq_lens, torch.int32, device),
        block_tables=list_to_device([t + [0] * (width - len(t)) for t in plan.block_tables], torch.int32, device),
        slot_mapping=list_to_device(slots, torch.int64, device),
        block_size=block_size,
        max_q_len=max(plan.q_start[i + 1] - plan.q_start[i] for i in range(len(plan.seq_lens))),
        max_seq_len=max(plan.seq_lens),
        q_start_host=plan.q_start,
        seq_lens_host=plan.seq_lens,
        block_tables_host=plan.block_tables,
    )
    return ForwardBatch(
        input_ids=torch.empty(plan.num_tokens, dtype=torch.int64, device=device),
        positions=list_to_device(positions, torch.int64, device),
        attn=attn,
        lora=None,  # the sharded decoder builds its own LoRA metadata (lora.py)
        sample_index=list_to_device(plan.sample_rows, torch.int64, device),
        seqs=[],
        sampled=[],
    )
