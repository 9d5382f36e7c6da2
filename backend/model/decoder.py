"""The decoder forward (Llama / Mistral / Qwen2) over a flat batch that mixes prefill and decode tokens.

Base matmuls are shared by all tokens; each LoRA-targeted projection then adds every token's own x·A·B·scale
through `ops.lora`, reading adapter rows from the page pool. K/V live in the same pool (see page_pool.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slora.backend.executor.batch import ForwardBatch
from slora.backend.memory.page_pool import PagePool
from slora.backend.model.rope import RotaryTable
from slora.backend.model.spec import LORA_MODULES, ModelSpec
from slora.backend.model.weights import LayerWeights, ModelWeights
from slora.kernels.ops import Ops

Q_PROJ, K_PROJ, V_PROJ, O_PROJ, GATE_PROJ, UP_PROJ, DOWN_PROJ = range(len(LORA_MODULES))


class DecoderModel:
    def __init__(self, spec: ModelSpec, weights: ModelWeights, ops: Ops, max_positions: int) -> None:
        self.spec = spec
        self.weights = weights
        self.ops = ops
        embed = weights.embed
        self.rope = RotaryTable(spec.rope, spec.head_dim, max_positions, embed.dtype, embed.device)
        self.scale = spec.head_dim**-0.5
        self._widths: dict[tuple[int, ...], tuple[int, ...]] = {}  # output widths of each LoRA call's modules

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: PagePool, into: torch.Tensor | None = None) -> torch.Tensor:
        """Run every token of the batch; return float32 logits [num_sampled, vocab] of the sampled rows, written into
        `into` when given (the one buffer every captured graph writes, cuda_graphs.py).

        Each sublayer's output is added to the residual stream by the next norm (ops.rms_norm fuses the add), so
        the stream after the last layer is out + residual.
        """
        out = self._embed(batch.input_ids)  # [num_tokens, hidden]
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.weights.layers):
            out, residual = self._layer(i, layer, out, residual, batch, pool)
        rows = batch.sample_index
        last, _ = self.ops.rms_norm(out[rows], self.weights.final_norm, self.spec.rms_norm_eps, _rows(residual, rows))
        return self._logits(last, into)

    def _layer(
        self,
        i: int,
        w: LayerWeights,
        out: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        pool: PagePool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.spec.rms_norm_eps
        x, residual = self.ops.rms_norm(out, w.input_norm, eps, residual)
        x, residual = self.ops.rms_norm(self._attention(i, w, x, batch, pool), w.post_norm, eps, residual)
        return self._mlp(i, w, x, batch, pool), residual

    def _attention(self, i: int, w: LayerWeights, x: torch.Tensor, batch: ForwardBatch, pool: PagePool) -> torch.Tensor:
        s = self.spec
        qkv = self.ops.linear(x, w.qkv, w.qkv_bias)  # [num_tokens, q_size + 2 * kv_size]
        self._lora(i, qkv, x, batch, pool, (Q_PROJ, K_PROJ, V_PROJ), (0, s.q_size, s.q_size + s.kv_size))
        q, k, v = qkv.split((s.q_size, s.kv_size, s.kv_size), dim=-1)
        q = q.view(-1, s.num_heads, s.head_dim)
        k = k.view(-1, s.num_kv_heads, s.head_dim)
        v = v.reshape(-1, s.num_kv_heads, s.head_dim)
        kv_layer = pool.kv_layer(i)
        # q and k rotated in place (inside qkv), then k and v stored in their pool slots
        self.ops.rotary_write_kv(q, k, v, batch.positions, self.rope.cos, self.rope.sin, kv_layer, batch.attn)
        attn = self.ops.attention(q, kv_layer, batch.attn, self.scale).reshape(-1, s.q_size)
        out = self.ops.linear(attn, w.o)  # [num_tokens, hidden]
        self._lora(i, out, attn, batch, pool, (O_PROJ,), (0,))
        return self._reduce(out)

    def _mlp(self, i: int, w: LayerWeights, x: torch.Tensor, batch: ForwardBatch, pool: PagePool) -> torch.Tensor:
        inter = self.spec.intermediate_size
        gate_up = self.ops.linear(x, w.gate_up)  # [num_tokens, 2 * intermediate]
        self._lora(i, gate_up, x, batch, pool, (GATE_PROJ, UP_PROJ), (0, inter))
        act = self.ops.silu_mul(gate_up, inter)
        out = self.ops.linear(act, w.down)  # [num_tokens, hidden]
        self._lora(i, out, act, batch, pool, (DOWN_PROJ,), (0,))
        return self._reduce(out)

    # Tensor parallelism (backend/parallel/decoder.py) overrides these three and _lora: the vocabulary-parallel
    # embedding and logits, the all-reduce of the row-parallel projections' partial sums (o, down).

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weights.embed)

    def _logits(self, last: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        logits = F.linear(last, self.weights.lm_head)
        return logits.float() if into is None else into.copy_(logits)

    def _reduce(self, out: torch.Tensor) -> torch.Tensor:
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
        widths = self._widths.get(modules)
        if widths is None:
            widths = self._widths[modules] = tuple(self.spec.module_shape(LORA_MODULES[m])[1] for m in modules)
        self.ops.lora(y, x, pool.flat_layer(i), batch.lora, modules, offsets, widths)


def _rows(x: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if x is None else x[rows]
