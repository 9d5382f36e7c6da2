"""The decoder on one tensor-parallel rank: DecoderModel over the rank's shard, with the group's collectives.

Per layer, as Megatron: q/k/v and gate/up column-parallel (each rank its own heads and columns, no communication),
o and down row-parallel (a partial sum each, all-reduced once). The embedding is looked up in each rank's
vocabulary rows and all-reduced; the logits of the rank's vocabulary shard are gathered on rank 0, which samples.
The LoRA of every projection follows S-LoRA's partition (lora.py): an all-gather or all-reduce of r numbers per
token, nothing else.

Rank 0 runs `forward` from its ModelRunner as with one device: it first sends the followers the step (workers.py)
and broadcasts the input tokens; each follower runs `follow` on what it received. Both then run the same
layers, so the same collectives in the same order.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from slora.backend.executor.batch import ForwardBatch
from slora.backend.memory.adapter_cache import ResidentAdapter
from slora.backend.memory.page_pool import PagePool
from slora.backend.model.decoder import DOWN_PROJ, O_PROJ, DecoderModel
from slora.backend.model.spec import LORA_MODULES
from slora.backend.model.weights import ModelWeights
from slora.backend.parallel.adapter_shard import ShardedHostAdapter
from slora.backend.parallel.collectives import Collectives
from slora.backend.parallel.layout import ShardPlan
from slora.backend.parallel.lora import (
    AdapterKey,
    ShardedLora,
    ShardedLoraMeta,
    ShardedTablesCache,
    ShardRows,
    build_sharded_meta,
    lora_steps,
)
from slora.backend.parallel.messages import StepPlan
from slora.backend.parallel.step_plan import adapters_of, plan_of
from slora.kernels.ops import Ops
from slora.kernels.settings import KernelSettings

if TYPE_CHECKING:
    from slora.backend.parallel.workers import WorkerGroup


class ShardedDecoder(DecoderModel):
    def __init__(
        self,
        plan: ShardPlan,
        weights: ModelWeights,
        ops: Ops,
        max_positions: int,
        comm: Collectives,
        settings: KernelSettings,
    ) -> None:
        super().__init__(plan.local_spec(), weights, ops, max_positions)
        self.plan = plan
        self.comm = comm
        self.lora = ShardedLora(lora_steps(ops.name, settings), comm, plan)
        self.tables = ShardedTablesCache()
        self.workers: WorkerGroup | None = None  # rank 0: the followers, told each step before it runs
        self._step_lora: ShardedLoraMeta | None = None  # the running step's, read by every layer's _lora
        self._rows: dict[AdapterKey, tuple[ResidentAdapter, ShardRows]] = {}  # rank 0's adapters' ShardRows

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: PagePool, into: torch.Tensor | None = None) -> torch.Tensor:
        """Rank 0: tell the followers, then run the step; float32 logits [num_sampled, vocab], written into `into`
        when given. Any failure (a collective failed: a follower died) gives the group up and raises
        workers.TensorParallelError, naming the dead rank when one died (WorkerDiedError): the ranks are out of step
        once one leaves a forward."""
        if self.workers is None:
            raise RuntimeError("rank 0's decoder has no workers attached")
        began = time.perf_counter()
        plan = plan_of(batch, adapters_of(batch))
        try:
            self.workers.send_step(plan)
            if self.comm.timer is not None:
                self.comm.timer.add("step plan (host)", time.perf_counter() - began)
            self.comm.broadcast(batch.input_ids, label="input tokens")
            return self.run(batch, plan, self._adapter_rows(batch), pool, into)
        except Exception as exc:
            raise self.workers.error_for(exc) from exc

    @torch.inference_mode()
    def follow(self, plan: StepPlan, batch: ForwardBatch, adapters: list[ShardRows], pool: PagePool) -> None:
        """A follower: run rank 0's step (`batch` built from `plan`, step_plan.py); the logits stay on rank 0."""
        self.comm.broadcast(batch.input_ids, label="input tokens")
        self.run(batch, plan, adapters, pool)

    def run(
        self,
        batch: ForwardBatch,
        plan: StepPlan,
        adapters: list[ShardRows],
        pool: PagePool,
        into: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The forward of every rank, its LoRA metadata built from the plan's segments and the rank's rows."""
        device = pool.storage.device
        self._step_lora = build_sharded_meta(plan.seg_start, plan.seg_adapter, adapters, device, self.tables)
        try:
            return super().forward(batch, pool, into)
        finally:
            self._step_lora = None

    def _adapter_rows(self, batch: ForwardBatch) -> list[ShardRows]:
        """Rank 0: each adapter's ShardRows in segment order, kept from the step before while its ResidentAdapter
        is the same (a new one: copied into other pages)."""
        found: dict[AdapterKey, tuple[ResidentAdapter, ShardRows]] = {}
        for s in batch.seqs:
            resident = s.request.resident
            if resident is not None and resident.key not in found:
                cached = self._rows.get(resident.key)
                found[resident.key] = cached if cached is not None and cached[0] is resident else self._new(resident)
        self._rows = found
        return [rows for _, rows in found.values()]

    @staticmethod
    def _new(resident: ResidentAdapter) -> tuple[ResidentAdapter, ShardRows]:
        host = resident.host
        if not isinstance(host, ShardedHostAdapter):
            raise TypeError(f"adapter {host.name!r} was not read as a tensor-parallel shard")
        return resident, ShardRows.of(host, resident.a_rows, resident.b_rows)

    # ---- DecoderModel's hooks ---------------------------------------------------------------------------------

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.plan.first_token
        outside = (local < 0) | (local >= self.plan.vocab)
        out = F.embedding(local.clamp(0, self.plan.vocab - 1), self.weights.embed)  # [num_tokens, hidden]
        out.masked_fill_(outside[:, None], 0)
        self.comm.all_reduce(out, label="embedding all-reduce")
        return out

    def _logits(self, last: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        local = F.linear(last, self.weights.lm_head)  # [num_sampled, vocab / n]
        if local.shape[0] == 0:  # no sequence samples this step (prompt chunks): nothing to gather
            return local.new_zeros((0, self.plan.spec.vocab_size), dtype=torch.float32) if into is None else into
        gathered = self.comm.gather(local, label="logits gather")  # rank 0: [n, num_sampled, vocab / n]
        if gathered is None:
            return local  # a follower's, never read
        logits = gathered.permute(1, 0, 2).reshape(local.shape[0], -1)[:, : self.plan.spec.vocab_size]
        return logits.float() if into is None else into.copy_(logits)

    def _reduce(self, out: torch.Tensor) -> torch.Tensor:
        # the row-parallel partial sums (the LoRA's slices already added: lora.py)
        self.comm.all_reduce(out, label="base all-reduce")
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
        meta = self._step_lora
        if meta is None:
            return
        flat = pool.flat_layer(i)
        if modules[0] in (O_PROJ, DOWN_PROJ):
            self.lora.row(y, x, flat, meta, modules[0])
            return
        widths = tuple(self.spec.module_shape(LORA_MODULES[m])[1] for m in modules)
        self.lora.column(y, x, flat, meta, modules, offsets, widths)
