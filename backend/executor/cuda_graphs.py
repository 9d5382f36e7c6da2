"""CUDA graphs of decode steps: one captured forward per batch-size bucket, replayed with each step's metadata.

A decode step of a small batch is bound by the host: some ten launches per layer, plus Triton's argument handling
for each. A graph replays all of them with one launch. Shapes inside a graph are fixed, so each bucket owns static
buffers; before a replay the step's tensors are copied into them, padded to the bucket size:

    rows 0 .. n-1        the step's sequences (one token each)
    rows n .. size-1     padding: token 0, K/V slot -1 (not written), context of 1 token on page 0, no adapter

and the launchers read fixed bounds instead of the step's values (kernels/metadata.StaticBounds): decode tiles
(executor/static_lora.py) whose unused rows name a null adapter of rank 0, fused ranks of the graph's rank bound per
module, and the context bound max_model_len for the split of decode attention. Every kernel skips what lies
beyond the real ranks, tiles and lengths, so padding costs launches of idle programs, not wrong results.

Graphs are keyed by bucket, by the LoRA modules the step's adapters target, by a power-of-two bound on their
ranks and by whether the step's tokens belong to few adapters (KernelSettings.few_adapters: its LoRA kernels then
run on tensor-core tiles of 16 tokens). A graph launches the LoRA kernels of those modules only (an attention-only
adapter set, S-LoRA's S1, skips the MLP calls) with grids sized for that bound, not for max_lora_rank (256 by
default: rank-8 adapters would run in grids of idle rank programs and no K split). At start each bucket is
captured without LoRA and with all seven modules at max_lora_rank, and for the adapters in host memory
(`add_family`: their modules and largest rank, both tile kinds where a bucket can hold a step of few adapters); a
step replays the cheapest of these that covers it, and a step that only the first covers gets a graph of its own
keys, captured on first use (a one-time stall of that step). All graphs share one memory pool and are captured
largest first, so smaller ones reuse its blocks, and all write their logits into one buffer of max_num_seqs rows
(`logits_buffer`, the graphs of steps with prompts' too): logits kept per graph would add up to a float32 row of the
vocabulary per bucket row of every family, gigabytes with a vocabulary of 128k or more. One buffer is enough because
graphs replay one at a time on one stream and a step's sampling reads its logits, on that stream, before the next
replay. Only the Triton kernel backend can be captured (the torch reference reads host-side lists).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from slora.backend.executor.batch import ForwardBatch
from slora.backend.executor.graph_families import NO_MODULES, GraphFamilies, Modules
from slora.backend.executor.static_lora import StaticLora, decode_tiling
from slora.backend.memory.page_pool import PagePool
from slora.backend.model.decoder import DecoderModel
from slora.kernels.metadata import AttentionMeta, row_alignment
from slora.kernels.settings import KernelSettings

logger = logging.getLogger(__name__)


class GraphKey(NamedTuple):
    size: int  # bucket: sequences in the step, padded up to it
    modules: Modules  # LoRA modules some adapter of the step targets (empty: no adapter)
    max_rank: int  # bound on the step's adapter ranks: launch grids and row buffers are sized by it
    few: bool = (
        False  # the step's tokens belong to few adapters: tensor-core LoRA tiles (backend/executor/static_lora.py)
    )


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to 128, then of 32, ending at max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    size = 16
    while size < max_num_seqs:
        sizes.append(size)
        size += 16 if size < 128 else 32
    return sizes + [max_num_seqs]


def bucket_for(sizes: list[int], num_seqs: int) -> int:
    """The smallest of the ascending bucket `sizes` that holds num_seqs sequences: the graph a step replays."""
    return next(s for s in sizes if s >= num_seqs)


@dataclass(frozen=True)
class GraphLimits:
    max_num_seqs: int
    max_model_len: int
    max_lora_rank: int


class StaticDecode:
    """The static buffers of one bucket and the ForwardBatch built on them."""

    def __init__(self, key: GraphKey, limits: GraphLimits, pool: PagePool, row_align: int, few_adapters: int) -> None:
        """few_adapters: the most adapters of a step of few adapters (KernelSettings.few_adapters_max), which a graph
        of key.few sizes its tile buffer for."""
        size = key.size
        device = pool.storage.device
        block_size = pool.geometry.block_size
        max_blocks = -(-limits.max_model_len // block_size)

        def zeros(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.size = size
        self.input_ids = zeros(size, dtype=torch.int64)
        self.positions = zeros(size, dtype=torch.int64)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.block_tables = zeros(size, max_blocks)
        attn = AttentionMeta(
            q_start=torch.arange(size + 1, dtype=torch.int32, device=device),
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            slot_mapping=self.slot_mapping,
            block_size=block_size,
            max_q_len=1,
            max_seq_len=limits.max_model_len,
            q_start_host=list(range(size + 1)),
            seq_lens_host=[1] * size,
            block_tables_host=[[] for _ in range(size)],
        )
        tiling = decode_tiling(size, few_adapters if key.few else None)
        self._lora = (
            StaticLora(size, size, key.modules, key.max_rank, row_align, device, tiling) if key.modules else None
        )
        self.lora = self._lora.meta if self._lora is not None else None
        self.batch = ForwardBatch(
            input_ids=self.input_ids,
            positions=self.positions,
            attn=attn,
            lora=self.lora,
            sample_index=torch.arange(size, dtype=torch.int64, device=device),
            seqs=[],
            sampled=[],
        )

    def fill(self, batch: ForwardBatch) -> None:
        """Copy a decode step's tensors into the buffers; rows past the step become padding."""
        n = batch.num_tokens
        attn = batch.attn
        self.input_ids[:n].copy_(batch.input_ids)
        self.input_ids[n:].zero_()
        self.positions[:n].copy_(batch.positions)
        self.positions[n:].zero_()
        self.slot_mapping[:n].copy_(attn.slot_mapping)
        self.slot_mapping[n:].fill_(-1)
        self.seq_lens[:n].copy_(attn.seq_lens)
        self.seq_lens[n:].fill_(1)
        width = attn.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(attn.block_tables)
        self.block_tables[n:, 0].zero_()
        if self._lora is not None:
            assert batch.lora is not None  # graphs are keyed by the step's modules
            self._lora.fill(batch.lora, n)


class DecodeGraphs:
    """Captured decode forwards by bucket; `forward` replays the smallest bucket that holds the step."""

    def __init__(
        self,
        model: DecoderModel,
        pool: PagePool,
        limits: GraphLimits,
        *,
        settings: KernelSettings,
        capture: bool = True,
    ) -> None:
        """settings: the kernels' (the model's ops'), whose rule for steps of few adapters picks their graphs."""
        self.model = model
        self.pool = pool
        self.limits = limits
        self.settings = settings
        self.capture = capture  # False: run the static batches eagerly (tests the padding on any device)
        spec = model.spec
        widths = [pool.geometry.page_elems, spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size]
        self.row_align = row_alignment(torch.tensor(widths, dtype=torch.int64))
        self.sizes = bucket_sizes(limits.max_num_seqs)
        self._static: dict[GraphKey, StaticDecode] = {}
        self._graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._logits: torch.Tensor | None = None  # logits_buffer()
        self._pool_handle: Any = None  # one memory pool for every graph (mixed_graphs.py's too)
        self.families = GraphFamilies(limits.max_lora_rank)  # the generic family is captured at start

    def fits(self, batch: ForwardBatch) -> bool:
        return batch.attn.decode_only and batch.num_tokens <= self.sizes[-1]

    def capture_all(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool."""
        if not self.capture:
            return
        for size in reversed(self.sizes):
            self._capture(GraphKey(size, *self.families.generic))
            self._capture(GraphKey(size, NO_MODULES, 0))
        logger.info("captured %d decode CUDA graphs (batch sizes %s)", len(self._graphs), self.sizes)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [num_tokens, vocab] of a decode step, from the smallest bucket that holds it."""
        key = self.key(batch)
        static = self._buffers(key)
        static.fill(batch)
        if self.capture:
            if key not in self._graphs:
                logger.info("capturing the decode graph of %d sequences, LoRA modules %s, ranks up to %d", key.size,
                            sorted(key.modules), key.max_rank)  # fmt: skip
                self._capture(key)
            self._graphs[key].replay()
        else:
            self.model.forward(static.batch, self.pool, self.logits_buffer()[: key.size])
        return self.logits_buffer()[: batch.num_tokens]

    def add_family(self, modules: Modules, max_rank: int) -> None:
        """Capture every bucket for adapters of these modules and ranks up to max_rank (e.g. those in host
        memory), so that their steps replay graphs sized for them without a capture while serving."""
        family = self.families.add(modules, max_rank)
        if family is None:
            return
        modules, bound = family
        if self.capture:
            for size in reversed(self.sizes):
                self._capture(GraphKey(size, modules, bound))
                if size >= self.settings.few_adapters_min_tokens:
                    self._capture(GraphKey(size, modules, bound, few=True))
            logger.info("captured decode graphs for LoRA modules %s, ranks up to %d", sorted(modules), bound)

    def key(self, batch: ForwardBatch) -> GraphKey:
        """The graph a decode step replays: its bucket, and the cheapest captured family (modules, rank bound)
        that covers the step's adapters; the step's own family when only the generic one would."""
        size = bucket_for(self.sizes, batch.num_tokens)
        if batch.lora is None:
            return GraphKey(size, NO_MODULES, 0)
        modules, bound = self.families.of_step(batch.lora)
        return GraphKey(size, modules, bound, batch.lora.of_few_adapters(self.settings))

    def _buffers(self, key: GraphKey) -> StaticDecode:
        if key not in self._static:
            few_adapters = self.settings.few_adapters_max
            self._static[key] = StaticDecode(key, self.limits, self.pool, self.row_align, few_adapters)
        return self._static[key]

    def pool_handle(self) -> Any:
        """The memory pool every graph is captured in: graphs replay one at a time on one stream, so those of
        steps with prompts (mixed_graphs.py) share it too."""
        if self._pool_handle is None:
            self._pool_handle = torch.cuda.graph_pool_handle()
        return self._pool_handle

    def logits_buffer(self) -> torch.Tensor:
        """The float32 [max_num_seqs, vocab] buffer every graph writes its logits into (the module's docstring says
        why one is enough)."""
        if self._logits is None:
            self._logits = empty_logits(self.model, self.limits.max_num_seqs, self.pool.storage.device)
        return self._logits

    def _capture(self, key: GraphKey) -> None:
        out = self.logits_buffer()[: key.size]
        self._graphs[key], _ = capture_forward(self.model, self.pool, self._buffers(key).batch, self.pool_handle(), out)


def empty_logits(model: DecoderModel, rows: int, device: torch.device) -> torch.Tensor:
    """A float32 [rows, vocab] buffer for the logits the graphs write."""
    return torch.empty((rows, model.weights.lm_head.shape[0]), dtype=torch.float32, device=device)


def capture_forward(
    model: DecoderModel, pool: PagePool, batch: ForwardBatch, pool_handle: Any, out: torch.Tensor
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """The graph of one forward over a static batch, in the memory pool `pool_handle`, and the logits it writes
    into `out` (a buffer outside the graphs' pool, which every graph shares).

    A forward first runs eagerly on a side stream: it compiles the kernels and builds their launches, which the
    capture then records. The batch's buffers must hold a real step or padding that writes nothing to the pool."""
    stream = torch.cuda.Stream(pool.storage.device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model.forward(batch, pool, out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: captures also happen while serving (keys first seen then), when the adapter copier's
    # thread may be allocating pinned buffers or waiting on its events; only this thread's calls are checked.
    with torch.cuda.graph(graph, pool=pool_handle, capture_error_mode="thread_local"):
        logits = model.forward(batch, pool, out)
    return graph, logits
