"""Which part of the base model each tensor-parallel rank holds (Megatron's partition), checked once per model.

    rank r of n holds:                                        the step's data on every rank:
      q heads      r·H/n .. (r+1)·H/n - 1                       x (hidden states): replicated, [T, hidden]
      KV heads     r·K/n .. (r+1)·K/n - 1          (K ≥ n)      its own q / k / v heads and KV pages
                   the one KV head r·K//n          (K < n: each KV head on n/K ranks, its cache replicated)
      gate/up      rows r·I/n .. (r+1)·I/n - 1 (column-parallel)   →  silu(gate)·up of its own columns
      o, down      the matching input columns  (row-parallel)      →  a partial sum, all-reduced once each
      vocabulary   rows r·⌈V/n⌉ .. (r+1)·⌈V/n⌉ - 1 of embed / lm_head (the last shard zero-padded)
                   embedding: each rank looks up its rows (zeros elsewhere), all-reduced; logits: gathered on rank 0

The rank's ModelSpec (`local_spec`) is the full one with its own head counts, intermediate size and vocabulary
shard: the decoder runs on it unchanged (backend/parallel/decoder.py adds the collectives). How adapters follow
this partition is drawn in adapter_shard.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from slora.backend.model.spec import ModelSpec

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output features split
ROW_PARALLEL = ("o_proj", "down_proj")  # input features split; outputs are partial sums


@dataclass(frozen=True)
class ShardPlan:
    """The slice of every base-model tensor that rank `rank` of `size` holds (see top)."""

    spec: ModelSpec  # the full model's
    size: int
    rank: int

    def __post_init__(self) -> None:
        check_partition(self.spec, self.size)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in 0 .. {self.size - 1}, got {self.rank}")

    @property
    def heads(self) -> int:
        return self.spec.num_heads // self.size

    @property
    def kv_heads(self) -> int:
        return max(1, self.spec.num_kv_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        return self.rank * self.spec.num_kv_heads // self.size

    @property
    def intermediate(self) -> int:
        return self.spec.intermediate_size // self.size

    @property
    def hidden(self) -> int:
        """Columns of the hidden state this rank adds a row-parallel LoRA's output to (adapter_shard.py)."""
        return self.spec.hidden_size // self.size

    @property
    def vocab(self) -> int:
        """Rows of the vocabulary shard (⌈V/n⌉: the last rank's is zero-padded)."""
        return -(-self.spec.vocab_size // self.size)

    @property
    def first_token(self) -> int:
        return self.rank * self.vocab

    def local_spec(self) -> ModelSpec:
        """The spec of this rank's shard: its head counts, intermediate size and vocabulary shard."""
        return dataclasses.replace(
            self.spec,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            intermediate_size=self.intermediate,
            vocab_size=self.vocab,
        )

    def out_range(self, module: str) -> tuple[int, int]:
        """[start, end) of the output features a column-parallel projection's shard holds."""
        hd = self.spec.head_dim
        if module == "q_proj":
            return self.rank * self.heads * hd, (self.rank + 1) * self.heads * hd
        if module in ("k_proj", "v_proj"):
            return self.first_kv_head * hd, (self.first_kv_head + self.kv_heads) * hd
        if module in ("gate_proj", "up_proj"):
            return self.rank * self.intermediate, (self.rank + 1) * self.intermediate
        raise ValueError(f"{module} is not column-parallel")

    def in_range(self, module: str) -> tuple[int, int]:
        """[start, end) of the input features a row-parallel projection's shard holds."""
        if module == "o_proj":
            return self.out_range("q_proj")
        if module == "down_proj":
            return self.out_range("gate_proj")
        raise ValueError(f"{module} is not row-parallel")

    def hidden_range(self) -> tuple[int, int]:
        """[start, end) of the hidden columns this rank adds a row-parallel LoRA's output to."""
        return self.rank * self.hidden, (self.rank + 1) * self.hidden


def check_partition(spec: ModelSpec, size: int) -> None:
    """Raise ValueError, naming tensor_parallel_size and the model's numbers, unless `size` ranks can split it."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    needs = {
        "num_attention_heads": spec.num_heads,
        "intermediate_size": spec.intermediate_size,
        "hidden_size": spec.hidden_size,
    }
    for name, value in needs.items():
        if value % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the model's {name} ({value})")
    kv = spec.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(
            f"tensor_parallel_size={size} and the model's num_key_value_heads ({kv}): one must divide the other "
            "(KV heads are split across ranks, or each replicated on tensor_parallel_size / heads ranks)"
        )


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: the CPU, or the rank-th GPU from the configured one (cuda → cuda:rank)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)
