"""The decoder forward (Llama / Mistral / Qwen2) over a flat batch that mixes prefill and decode tokens.

Base matmuls are shared by all tokens; each LoRA-targeted projection then adds every token's own x·A·B·scale
through `ops.lora`, reading adapter rows from the page pool. K/V live in the same pool (see page_pool.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slora.backend.batch import ForwardBatch
from slora.backend.model_spec import LORA_MODULES, ModelSpec
from slora.backend.page_pool import PagePool
from slora.backend.rope import RotaryTable, apply_rotary
from slora.backend.weights import LayerWeights, ModelWeights
from slora.kernels.ops import Ops

Q_PROJ, K_PROJ, V_PROJ, O_PROJ, GATE_PROJ, UP_PROJ, DOWN_PROJ = range(len(LORA_MODULES))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as Hugging Face Llama does."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class DecoderModel:
    def __init__(self, spec: ModelSpec, weights: ModelWeights, ops: Ops, max_positions: int) -> None:
        self.spec = spec
        self.weights = weights
        self.ops = ops
        embed = weights.embed
        self.rope = RotaryTable(spec.rope, spec.head_dim, max_positions, embed.dtype, embed.device)
        self.scale = spec.head_dim**-0.5

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: PagePool) -> torch.Tensor:
        """Run every token of the batch; return float32 logits [num_sampled, vocab] of the sampled rows."""
        h = F.embedding(batch.input_ids, self.weights.embed)  # h: [num_tokens, hidden]
        cos, sin = self.rope.lookup(batch.positions)
        for i, layer in enumerate(self.weights.layers):
            h = self._layer(i, layer, h, cos, sin, batch, pool)
        last = h[batch.sample_index]  # [num_sampled, hidden]
        last = rms_norm(last, self.weights.final_norm, self.spec.rms_norm_eps)
        return F.linear(last, self.weights.lm_head).float()

    def _layer(
        self,
        i: int,
        w: LayerWeights,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        pool: PagePool,
    ) -> torch.Tensor:
        h = h + self._attention(i, w, rms_norm(h, w.input_norm, self.spec.rms_norm_eps), cos, sin, batch, pool)
        return h + self._mlp(i, w, rms_norm(h, w.post_norm, self.spec.rms_norm_eps), batch, pool)

    def _attention(
        self,
        i: int,
        w: LayerWeights,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        pool: PagePool,
    ) -> torch.Tensor:
        s = self.spec
        qkv = F.linear(x, w.qkv, w.qkv_bias)  # [num_tokens, q_size + 2 * kv_size]
        self._lora(i, qkv, x, batch, pool, (Q_PROJ, K_PROJ, V_PROJ), (0, s.q_size, s.q_size + s.kv_size))
        q, k, v = qkv.split((s.q_size, s.kv_size, s.kv_size), dim=-1)
        q = apply_rotary(q.view(-1, s.num_heads, s.head_dim), cos, sin)
        k = apply_rotary(k.view(-1, s.num_kv_heads, s.head_dim), cos, sin)
        v = v.reshape(-1, s.num_kv_heads, s.head_dim)
        kv_layer = pool.kv_layer(i)
        self.ops.write_kv(k, v, kv_layer, batch.attn)
        attn = self.ops.attention(q, kv_layer, batch.attn, self.scale).reshape(-1, s.q_size)
        out = F.linear(attn, w.o)  # [num_tokens, hidden]
        self._lora(i, out, attn, batch, pool, (O_PROJ,), (0,))
        return out

    def _mlp(self, i: int, w: LayerWeights, x: torch.Tensor, batch: ForwardBatch, pool: PagePool) -> torch.Tensor:
        inter = self.spec.intermediate_size
        gate_up = F.linear(x, w.gate_up)  # [num_tokens, 2 * intermediate]
        self._lora(i, gate_up, x, batch, pool, (GATE_PROJ, UP_PROJ), (0, inter))
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out = F.linear(act, w.down)  # [num_tokens, hidden]
        self._lora(i, out, act, batch, pool, (DOWN_PROJ,), (0,))
        return out

    def _lora(
        self,
        i: int,
        y: torch.Tensor,
        x: torch.Tensor,
        batch: ForwardBatch,
        pool: PagePool,
        modules: tuple[int, ...],
        offsets: tuple[int, ...],
    ) -> None:
        if batch.lora is None:
            return
        widths = tuple(self.spec.module_shape(LORA_MODULES[m])[1] for m in modules)
        self.ops.lora(y, x, pool.flat_layer(i), batch.lora, modules, offsets, widths)
