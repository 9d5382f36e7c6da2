"""Per-step metadata read by every attention and LoRA op: built once per step by the engine, outside the model.

Device tensors feed the Triton kernels; the `*_host` lists carry the same numbers for the torch reference path,
so that it needs no device-to-host synchronization.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMeta:
    """Where each sequence's new tokens are and which pool pages hold its K/V.

    Tokens of the step are laid out sequence after sequence: sequence i owns rows q_start[i]:q_start[i+1] of
    q/k/v. Its new tokens sit at positions seq_lens[i] - q_len .. seq_lens[i] - 1 of its context.
    """

    q_start: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length, new tokens included
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]: pool page of each block (0-padded)
    slot_mapping: torch.Tensor  # int64 [num_tokens]: page * block_size + offset where each new token's K/V goes
    block_size: int
    max_q_len: int
    max_seq_len: int
    q_start_host: list[int]
    seq_lens_host: list[int]
    block_tables_host: list[list[int]]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def decode_only(self) -> bool:
        return self.max_q_len == 1


@dataclass
class LoraMeta:
    """Which adapter each token uses and where that adapter's rows lie in the pool.

    Tokens are grouped so that those of one adapter are contiguous: segment g covers tokens
    seg_start[g]:seg_start[g+1], all using active adapter seg_adapter[g]. Tokens of the base model belong to no
    segment. Module index m follows LORA_MODULES (q, k, v, o, gate, up, down). For active adapter a and module m,
    rows row_start[a, m] .. row_start[a, m] + ranks[a, m] - 1 of a_rows/b_rows give the flat element offsets (in
    one pool layer) of its lora_A rows ([in_features] each) and lora_Bᵀ rows ([out_features] each).
    """

    token_adapter: torch.Tensor  # int32 [num_tokens]: active adapter index, -1 for none
    seg_start: torch.Tensor  # int32 [num_segments + 1]
    seg_adapter: torch.Tensor  # int32 [num_segments]
    ranks: torch.Tensor  # int32 [num_adapters, 7]
    scales: torch.Tensor  # float32 [num_adapters, 7]
    row_start: torch.Tensor  # int32 [num_adapters, 7]
    a_rows: torch.Tensor  # int64 [total_rows]
    b_rows: torch.Tensor  # int64 [total_rows]
    max_rank: int
    seg_start_host: list[int]
    seg_adapter_host: list[int]
    ranks_host: list[list[int]]
    scales_host: list[list[float]]
    row_start_host: list[list[int]]

    @property
    def num_segments(self) -> int:
        return len(self.seg_adapter_host)
