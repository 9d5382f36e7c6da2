"""One rank's shard of the base model (layout.py says which slices), read straight from the safetensors files.

Only the rank's slice of each tensor is read (safetensors slices without loading the whole tensor), so a 70B
checkpoint costs each of 8 ranks about 1/8 of it in host memory and time. Full shapes are checked against the
model's spec as for one device (checkpoint.py). `load_format=dummy` draws each rank's shard at random (seeded by
the rank: outputs then differ from a dummy model on one device).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from slora.backend.errors import ModelLoadError
from slora.backend.model.checkpoint import _expected_shape, _safetensors_files, _tensor_index, random_weights
from slora.backend.model.weights import LayerWeights, ModelWeights
from slora.backend.parallel.layout import ShardPlan

logger = logging.getLogger(__name__)

Span = tuple[int, int]


class ShardReader:
    """Reads row or column slices of a checkpoint's tensors, cast to the model's dtype on the rank's device."""

    def __init__(self, path: Path, plan: ShardPlan, dtype: torch.dtype, device: torch.device) -> None:
        self.path = path
        self.plan = plan
        self.dtype = dtype
        self.device = device
        self._index = _tensor_index(_safetensors_files(path))

    def read(self, name: str, rows: Span | None = None, cols: Span | None = None) -> torch.Tensor:
        """Rows [start, end) or columns [start, end) of tensor `name` (all of it without either)."""
        for candidate in (name, name.removeprefix("model.")):
            if candidate in self._index:
                with safe_open(str(self._index[candidate]), framework="pt") as handle:
                    part = handle.get_slice(candidate)
                    self._check_shape(name, tuple(part.get_shape()))
                    tensor = part[rows[0] : rows[1]] if rows else part[:, cols[0] : cols[1]] if cols else part[:]
                return tensor.to(dtype=self.dtype, device=self.device)
        raise ModelLoadError(f"{self.path}: tensor {name!r} is missing from the checkpoint")

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        expected = _expected_shape(name, self.plan.spec)
        if shape != expected:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has shape {shape}, expected {expected}")


def load_shard(path: str | Path, plan: ShardPlan, dtype: torch.dtype, device: torch.device) -> ModelWeights:
    """Rank plan.rank's weights in the engine's layout (fused q/k/v and gate/up of its own heads and columns)."""
    reader = ShardReader(Path(path), plan, dtype, device)
    logger.info("loading tensor-parallel shard %d/%d from %s", plan.rank, plan.size, path)
    layers = [_layer(reader, i) for i in range(plan.spec.num_layers)]
    embed = _vocab_rows(reader, "model.embed_tokens.weight")
    lm_head = embed if plan.spec.tie_word_embeddings else _vocab_rows(reader, "lm_head.weight")
    return ModelWeights(embed=embed, layers=layers, final_norm=reader.read("model.norm.weight"), lm_head=lm_head)


def random_shard(plan: ShardPlan, dtype: torch.dtype, device: torch.device, seed: int) -> ModelWeights:
    """Random weights of the shard's shapes, drawn with `seed` + rank (benchmarks without a checkpoint)."""
    return random_weights(plan.local_spec(), dtype, device, seed=seed + plan.rank)


def _layer(reader: ShardReader, i: int) -> LayerWeights:
    plan = reader.plan
    p = f"model.layers.{i}."
    attn = [(p + f"self_attn.{m}", plan.out_range(m)) for m in ("q_proj", "k_proj", "v_proj")]
    qkv = torch.cat([reader.read(name + ".weight", rows=span) for name, span in attn])
    bias = None
    if plan.spec.qkv_bias:
        bias = torch.cat([reader.read(name + ".bias", rows=span) for name, span in attn])
    mlp = [(p + f"mlp.{m}.weight", plan.out_range(m)) for m in ("gate_proj", "up_proj")]
    return LayerWeights(
        input_norm=reader.read(p + "input_layernorm.weight"),
        qkv=qkv,
        qkv_bias=bias,
        o=reader.read(p + "self_attn.o_proj.weight", cols=plan.in_range("o_proj")),
        post_norm=reader.read(p + "post_attention_layernorm.weight"),
        gate_up=torch.cat([reader.read(name, rows=span) for name, span in mlp]),
        down=reader.read(p + "mlp.down_proj.weight", cols=plan.in_range("down_proj")),
    )


def _vocab_rows(reader: ShardReader, name: str) -> torch.Tensor:
    """The rank's vocabulary rows, zero rows past the vocabulary (the last shard of a vocabulary not divisible)."""
    plan = reader.plan
    start = plan.first_token
    end = min(start + plan.vocab, plan.spec.vocab_size)
    if end <= start:  # a vocabulary smaller than the ranks' shards: this one holds padding only
        reader.read(name, rows=(0, 0))  # its shape is checked all the same
        return torch.zeros((plan.vocab, plan.spec.hidden_size), dtype=reader.dtype, device=reader.device)
    rows = reader.read(name, rows=(start, end))
    return F.pad(rows, (0, 0, 0, plan.vocab - rows.shape[0])) if rows.shape[0] < plan.vocab else rows
