"""Base-model weights in the engine's layout: fused q/k/v and gate/up projections, one record per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]  (rows: q, then k, then v)
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size] (Qwen2)
    o: torch.Tensor  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]  (rows: gate, then up)
    down: torch.Tensor  # [hidden, intermediate]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the same storage as `embed` when tied

    def nbytes(self) -> int:
        tensors = [self.embed, self.final_norm]
        if self.lm_head.data_ptr() != self.embed.data_ptr():
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors += [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down]
            if layer.qkv_bias is not None:
                tensors.append(layer.qkv_bias)
        return sum(t.numel() * t.element_size() for t in tensors)
