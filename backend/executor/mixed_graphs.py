"""CUDA graphs of steps with prompts: one captured forward per bucket of tokens and sequences, replayed with each
step's metadata.

An eager step with prompts launches some fifteen kernels a layer, and on the GPU host their launches take longer
than the GPU takes to run them (perf/RESULTS.md, "Where the time goes"); while requests arrive, every admission step
is such a step. A graph replays them with one launch. Shapes inside a graph are fixed, so a step of T tokens and S
sequences is padded to its bucket (`tokens`, `seqs`):

    token rows 0 .. T-1          the step's tokens, sequence after sequence
    token rows T .. tokens-1     padding: K/V slot -1 (not written), in no attention or LoRA tile; their token and
                                 position are whatever an earlier step left (valid ones), their outputs never read
    sequences 0 .. S-1           the step's query starts, context lengths and block tables
    sampled rows                 the step's, then row 0 up to `seqs` (the padding's logits are not read)

Attention runs in two launches, as an eager step with decodes and prompts does (metadata.length_groups): sequences
of up to SHORT_SEGMENT new tokens on short query tiles, one each, and longer ones on prompt-sized tiles. Each group's
tile buffer holds the most tiles a step of the bucket can have; the tiles past the step's name the null sequence
(row `max seqs` of the buffers: no token, no context), whose programs exit at once. LoRA runs in two launch groups
too with KernelSettings.graph_lora_split, as an eager step's does with lora_split: adapters of up to SHORT_SEGMENT
tokens in the step (their decodes) on the GEMV kernels, the others on prompt tiles; by default in one group on
16-token tensor-core tiles (static_lora.mixed_tiling). Logits are copied into one buffer that every graph shares, so
that no graph keeps a [seqs, vocab] output of its own.

Token, sequence and tile buffers are shared by all graphs (views of the largest bucket's): graphs replay one at a
time on one stream, and each step fills what its graph reads. Graphs are keyed by bucket and LoRA family
(graph_families.py). At start every bucket is captured without LoRA and, once the adapters in host memory are known
(add_family), for their family; a step of other adapters gets its own family's graph on first use (a one-time stall
of that step). Graphs are captured largest first in the decode graphs' memory pool.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from slora.backend.executor.batch import ForwardBatch
from slora.backend.executor.cuda_graphs import bucket_for, capture_forward, empty_logits
from slora.backend.executor.graph_families import NO_MODULES, GraphFamilies, Modules
from slora.backend.executor.static_lora import StaticLora, mixed_tiling
from slora.backend.memory.page_pool import PagePool
from slora.backend.model.decoder import DecoderModel
from slora.kernels.metadata import SHORT_SEGMENT, AttentionMeta, SegmentGroup, StaticBounds, tile_rows, upload
from slora.kernels.settings import KernelSettings
from slora.kernels.triton.launch import cdiv

logger = logging.getLogger(__name__)

TOKEN_STEP = 128  # token buckets above the powers of two: a step's padding is less than this many tokens


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, then steps of TOKEN_STEP, ending at max_tokens."""
    sizes = [s for s in (16, 32, 64) if s < max_tokens]
    size = TOKEN_STEP
    while size < max_tokens:
        sizes.append(size)
        size += TOKEN_STEP
    return sizes + [max_tokens]


def seq_buckets(max_seqs: int) -> list[int]:
    """Powers of two from 16, ending at max_seqs."""
    sizes = []
    size = 16
    while size < max_seqs:
        sizes.append(size)
        size *= 2
    return sizes + [max_seqs]


class MixedKey(NamedTuple):
    tokens: int  # bucket: tokens of the step, padded up to it
    seqs: int  # bucket: sequences of the step (and sampled rows), padded up to it
    modules: Modules  # LoRA modules some adapter of the step targets (empty: no adapter)
    max_rank: int  # bound on the step's adapter ranks
    few: bool = False  # graph_lora_split: a step of few adapters (KernelSettings.few_adapters), prompt tiles alone


@dataclass(frozen=True)
class MixedLimits:
    max_tokens: int  # EngineConfig.mixed_cuda_graph_tokens: larger steps run eagerly
    max_seqs: int  # EngineConfig.max_num_seqs
    max_model_len: int
    max_lora_rank: int


@dataclass(frozen=True)
class TileShapes:
    """Query tokens per tile of the short (decode) and the long (prompt) attention group, for the pool's dtype."""

    short: int
    long: int

    @classmethod
    def of(cls, dtype: torch.dtype) -> TileShapes:
        # The attention configs are the Triton kernels'; imported here, when graphs are built (an engine without
        # graphs runs without the triton package).
        from slora.kernels.triton.paged_attention import attention_config

        size = torch.empty((), dtype=dtype).element_size()
        return cls(attention_config(size, 1).block_m, attention_config(size, SHORT_SEGMENT + 1).block_m)

    def long_tiles(self, tokens: int, seqs: int) -> int:
        """The most prompt tiles of a step of `tokens` tokens and `seqs` sequences: each prompt (over SHORT_SEGMENT
        tokens, so at most tokens // (SHORT_SEGMENT + 1) of them) adds at most one partial tile."""
        return cdiv(tokens, self.long) + min(seqs, tokens // (SHORT_SEGMENT + 1))


class MixedBuffers:
    """The buffers every mixed graph reads, sized for the largest bucket; `null` is the null sequence's row."""

    def __init__(self, limits: MixedLimits, pool: PagePool, shapes: TileShapes) -> None:
        device = pool.storage.device
        tokens, seqs = limits.max_tokens, limits.max_seqs
        max_blocks = cdiv(limits.max_model_len, pool.geometry.block_size)
        self.device = device
        self.shapes = shapes
        self.null = seqs
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        # the null sequence (row `seqs`) reads the last end of a full bucket: any value does, its context is empty
        self.q_start = torch.zeros(seqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(seqs + 1, dtype=torch.int32, device=device)  # the null sequence's stays 0
        self.block_tables = torch.zeros((seqs + 1, max_blocks), dtype=torch.int32, device=device)
        self.sample_index = torch.zeros(seqs, dtype=torch.int64, device=device)
        self.short_tiles = self._null_tiles(seqs)
        self.long_tiles = self._null_tiles(shapes.long_tiles(tokens, seqs))

    def _null_tiles(self, rows: int) -> torch.Tensor:
        return torch.tensor([[self.null, 0, 0, self.null]] * rows, dtype=torch.int32, device=self.device)

    def clear(self) -> None:
        """Padding everywhere: no K/V slot, no tile (a forward over the buffers then writes nothing to the pool)."""
        self.slot_mapping.fill_(-1)
        self.short_tiles.copy_(self._null_tiles(self.short_tiles.shape[0]))
        self.long_tiles.copy_(self._null_tiles(self.long_tiles.shape[0]))
        self.sample_index.zero_()

    def attention(self, key: MixedKey, pool: PagePool) -> AttentionMeta:
        """The attention metadata a graph of `key` is captured with: views of the buffers, static tile groups."""
        shapes = self.shapes
        short = StaticBounds(0, self.short_tiles[: key.seqs], shapes.short, NO_MODULES, "decode", 1)
        long_rows = shapes.long_tiles(key.tokens, key.seqs)
        long = StaticBounds(0, self.long_tiles[:long_rows], shapes.long, NO_MODULES, "prompts", shapes.long)
        return AttentionMeta(
            q_start=self.q_start,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            slot_mapping=self.slot_mapping[: key.tokens],
            block_size=pool.geometry.block_size,
            max_q_len=key.tokens,
            max_seq_len=self.block_tables.shape[1] * pool.geometry.block_size,
            q_start_host=[0, key.tokens],
            seq_lens_host=[key.tokens],
            block_tables_host=[],
            static_groups=[SegmentGroup([], self.device, short), SegmentGroup([], self.device, long)],
        )

    def fill(self, batch: ForwardBatch, key: MixedKey) -> None:
        """Copy a step's tensors into the buffers; its padding rows get no K/V slot, its padding sampled rows row 0,
        and its tiles past the step's the null sequence."""
        n, attn = batch.num_tokens, batch.attn
        seqs, sampled = attn.num_seqs, int(batch.sample_index.shape[0])
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(attn.slot_mapping)
        self.slot_mapping[n : key.tokens].fill_(-1)
        self.q_start[: seqs + 1].copy_(attn.q_start)
        self.seq_lens[:seqs].copy_(attn.seq_lens)
        self.block_tables[:seqs, : attn.block_tables.shape[1]].copy_(attn.block_tables)
        self.sample_index[:sampled].copy_(batch.sample_index)
        self.sample_index[sampled : key.seqs].zero_()
        short, long = self.tiles(attn.q_start_host, key)
        upload(self.short_tiles[: key.seqs], short)
        upload(self.long_tiles[: long.shape[0]], long)

    def tiles(self, q_start: list[int], key: MixedKey) -> tuple[torch.Tensor, torch.Tensor]:
        """Host int32 tiles (sequence, first row, end row, sequence) of the short and the long group, each padded
        with null tiles to its graph's rows."""
        starts = np.asarray(q_start, dtype=np.int64)
        seqs = np.arange(starts.shape[0] - 1)
        segments = np.stack([seqs, starts[:-1], starts[1:], seqs], 1)
        is_short = segments[:, 2] - segments[:, 1] <= SHORT_SEGMENT
        short_tiles = segments[is_short]  # a tile each
        long_tiles = tile_rows(segments[~is_short], self.shapes.long)
        rows = self.shapes.long_tiles(key.tokens, key.seqs)
        if long_tiles.shape[0] > rows or short_tiles.shape[0] > key.seqs:
            raise ValueError(f"a step of {long_tiles.shape[0]} prompt tiles and {short_tiles.shape[0]} short "
                             f"sequences does not fit the graph of {rows} and {key.seqs}")  # fmt: skip
        null_tile = np.array([[self.null, 0, 0, self.null]], dtype=np.int32)
        short = np.repeat(null_tile, key.seqs, axis=0)
        short[: short_tiles.shape[0]] = short_tiles
        long = np.repeat(null_tile, rows, axis=0)
        long[: long_tiles.shape[0]] = long_tiles
        return torch.from_numpy(short), torch.from_numpy(long)


class MixedStatic:
    """The ForwardBatch a graph of one key is captured with, and its own LoRA buffers."""

    def __init__(
        self, key: MixedKey, buffers: MixedBuffers, pool: PagePool, row_align: int, settings: KernelSettings
    ) -> None:
        """settings: graph_lora_split, the LoRA's short segments launched apart from its long ones, and the most
        adapters of a step of few adapters (static_lora.mixed_tiling)."""
        self.key = key
        lora = None
        if key.modules:
            few = settings.few_adapters_max if key.few else None
            tiling = mixed_tiling(key.tokens, key.seqs, settings.graph_lora_split, few)
            lora = StaticLora(key.tokens, key.seqs, key.modules, key.max_rank, row_align, buffers.device, tiling)
        self._lora = lora
        self.batch = ForwardBatch(
            input_ids=buffers.input_ids[: key.tokens],
            positions=buffers.positions[: key.tokens],
            attn=buffers.attention(key, pool),
            lora=lora.meta if lora is not None else None,
            sample_index=buffers.sample_index[: key.seqs],
            seqs=[],
            sampled=[],
        )

    def fill(self, batch: ForwardBatch) -> None:
        if self._lora is not None:
            assert batch.lora is not None  # graphs are keyed by the step's modules
            self._lora.fill(batch.lora, batch.num_tokens)


class MixedGraphs:
    """Captured forwards of steps with prompts by bucket; `forward` replays the smallest bucket that holds the step."""

    def __init__(
        self,
        model: DecoderModel,
        pool: PagePool,
        limits: MixedLimits,
        *,
        row_align: int,
        settings: KernelSettings,
        pool_handle: Any = None,
        logits: torch.Tensor | None = None,
        capture: bool = True,
    ) -> None:
        """row_align: the decode graphs' (every LoRA row offset is a multiple of it); settings: the kernels' (the
        model's ops'), whose graph_lora_split picks the graphs' LoRA groups; pool_handle: the decode
        graphs' memory pool (DecodeGraphs.pool_handle), or None for one of their own; logits: the decode graphs'
        logits buffer (DecodeGraphs.logits_buffer, at least limits.max_seqs rows), or None for one of their own."""
        self.model = model
        self.pool = pool
        self.limits = limits
        self.row_align = row_align
        self.settings = settings
        self.capture = capture  # False: run the static batches eagerly (tests the padding on any device)
        self.token_sizes = token_buckets(limits.max_tokens)
        self.seq_sizes = seq_buckets(limits.max_seqs)
        self.buffers = MixedBuffers(limits, pool, TileShapes.of(pool.storage.dtype))
        self.families = GraphFamilies(limits.max_lora_rank)
        self._static: dict[MixedKey, MixedStatic] = {}
        self._graphs: dict[MixedKey, torch.cuda.CUDAGraph] = {}
        self._pool_handle = pool_handle
        self._logits = logits  # [max seqs, vocab] at least: every graph writes its logits there

    def fits(self, batch: ForwardBatch) -> bool:
        attn = batch.attn
        return not attn.decode_only and batch.num_tokens <= self.token_sizes[-1] and attn.num_seqs <= self.seq_sizes[-1]

    def keys(self, modules: Modules, max_rank: int) -> list[MixedKey]:
        """Every bucket of one family, largest first: each token bucket with the sequence buckets its steps can
        have (no more sequences than tokens); with graph_lora_split and LoRA, also each bucket's variant for steps
        of few adapters where its tokens can make one (at least few_adapters_min_tokens)."""
        keys = []
        few = bool(modules) and self.settings.graph_lora_split and self.settings.few_adapters_max > 0
        for tokens in reversed(self.token_sizes):
            most = bucket_for(self.seq_sizes, min(tokens, self.seq_sizes[-1]))
            for seqs in reversed(self.seq_sizes):
                if seqs <= most:
                    keys.append(MixedKey(tokens, seqs, modules, max_rank))
                    if few and tokens >= self.settings.few_adapters_min_tokens:
                        keys.append(MixedKey(tokens, seqs, modules, max_rank, few=True))
        return keys

    def capture_all(self) -> None:
        """Capture every bucket without LoRA."""
        if self.capture:
            self._capture_family(NO_MODULES, 0)

    def add_family(self, modules: Modules, max_rank: int) -> None:
        """Capture every bucket for adapters of these modules and ranks up to max_rank (those in host memory)."""
        family = self.families.add(modules, max_rank)
        if family is not None and self.capture:
            self._capture_family(family[0], family[1])

    def _capture_family(self, modules: Modules, max_rank: int) -> None:
        self.buffers.clear()  # each capture first runs its graph's forward: over padding, which writes nothing
        keys = self.keys(modules, max_rank)
        for key in keys:
            self._capture(key)
        logger.info("captured %d CUDA graphs of steps with prompts (LoRA modules %s, ranks up to %d; tokens %s, "
                    "sequences %s)", len(keys), sorted(modules), max_rank, self.token_sizes,
                    self.seq_sizes)  # fmt: skip

    def key(self, batch: ForwardBatch) -> MixedKey:
        tokens = bucket_for(self.token_sizes, batch.num_tokens)
        seqs = bucket_for(self.seq_sizes, batch.attn.num_seqs)
        if batch.lora is None:
            return MixedKey(tokens, seqs, NO_MODULES, 0)
        modules, bound = self.families.of_step(batch.lora)
        few = self.settings.graph_lora_split and batch.lora.of_few_adapters(self.settings)
        return MixedKey(tokens, seqs, modules, bound, few)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [num_sampled, vocab] of a step with prompts, from the smallest bucket that holds it."""
        key = self.key(batch)
        static = self._buffers(key)
        self.buffers.fill(batch, key)
        static.fill(batch)
        sampled = int(batch.sample_index.shape[0])
        if not self.capture:
            self.model.forward(static.batch, self.pool, self.logits_buffer()[: key.seqs])
        elif key in self._graphs:
            self._graphs[key].replay()
        else:
            logger.info("capturing the graph of steps with prompts of %d tokens, %d sequences, LoRA modules %s, "
                        "ranks up to %d", key.tokens, key.seqs, sorted(key.modules), key.max_rank)  # fmt: skip
            self._capture(key)
            self._graphs[key].replay()
        return self.logits_buffer()[:sampled]

    def logits_buffer(self) -> torch.Tensor:
        """The float32 [max seqs, vocab] buffer (at least) every graph writes its logits into: the decode graphs'
        when given (cuda_graphs.py says why one is enough)."""
        if self._logits is None:
            self._logits = empty_logits(self.model, self.limits.max_seqs, self.buffers.device)
        return self._logits

    def _buffers(self, key: MixedKey) -> MixedStatic:
        if key not in self._static:
            self._static[key] = MixedStatic(key, self.buffers, self.pool, self.row_align, self.settings)
        return self._static[key]

    def _capture(self, key: MixedKey) -> None:
        if self._pool_handle is None:
            self._pool_handle = torch.cuda.graph_pool_handle()
        out = self.logits_buffer()[: key.seqs]
        self._graphs[key], _ = capture_forward(self.model, self.pool, self._buffers(key).batch, self._pool_handle, out)
