"""Per-step metadata read by every attention and LoRA op: built once per step by the engine, outside the model.

Device tensors feed the Triton kernels; the `*_host` lists carry the same numbers for the torch reference path,
so that it needs no device-to-host synchronization.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from slora.kernels.settings import KernelSettings

TILE_COLUMNS = 4  # segment, first row, end row (of the segment), tag


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`, without making the host wait for the device.

    On CUDA the copy goes through page-locked memory (PyTorch's caching host allocator, which keeps the block until
    the copy is done): a copy from pageable memory may first wait for the stream to drain, which would hold the
    host up while an earlier step still runs (overlapped steps, backend/engine/llm_engine.py). Elsewhere a plain copy.
    """
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def upload(view: torch.Tensor, host: torch.Tensor) -> None:
    """Copy a host tensor into a device view without making the host wait (to_device says why)."""
    if view.device.type == "cuda":
        view.copy_(host.pin_memory(), non_blocking=True)
    else:
        view.copy_(host)


def tiles_of(segments: list[tuple[int, int, int, int]], block: int, device: torch.device) -> torch.Tensor:
    """int32 [num_tiles, 4]: (segment g, first row, end, tag) of every run of up to `block` rows of each
    (g, start row, end row, tag) segment, in their order.

    Empty segments get no tile. Kernels launch one program per tile, so that no program straddles two segments and
    none is spent on rows of no segment; the segment's end and tag (its adapter, for LoRA) ride along, which saves
    each program dependent loads.
    """
    tiles = [(g, row, end, tag) for g, start, end, tag in segments for row in range(start, end, block)]
    return to_device(torch.tensor(tiles, dtype=torch.int32).view(-1, TILE_COLUMNS), device)


def tile_rows(segments: np.ndarray, block: int) -> np.ndarray:
    """tiles_of's rows on the host, from an int64 [n, 4] array of (g, start row, end row, tag) segments: for the
    static tile buffers of a CUDA graph, refilled from each step's segments before its replay."""
    counts = -(-(segments[:, 2] - segments[:, 1]) // block)
    seg = np.repeat(np.arange(segments.shape[0]), counts)
    within = np.arange(seg.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
    rows = segments[seg]
    rows[:, 1] += within * block
    return rows


def row_alignment(rows: torch.Tensor, cap: int = 16) -> int:
    """The largest power of two up to `cap` that divides every offset in `rows` (lets kernels vectorize loads)."""
    return alignment_of(offsets_or(rows.numpy(force=True)), cap)


def offsets_or(offsets: np.ndarray) -> int:
    """The bitwise OR of every offset (0 for none): what alignment_of needs, and can be combined across arrays."""
    return int(np.bitwise_or.reduce(offsets, initial=0))


def alignment_of(offsets_or: int, cap: int = 16) -> int:
    """row_alignment from the bitwise OR of the offsets: a power of two divides them all exactly when it divides
    their OR, and the largest one that does is the OR's lowest set bit (none: every offset is 0)."""
    return min(cap, offsets_or & -offsets_or) if offsets_or else cap


SHORT_SEGMENT = 16  # segments of up to this many tokens (decodes) get decode-shaped tiles


@dataclass
class SegmentGroup:
    """Segments of a step launched together, so with one tile shape (picked from tile_len).

    A segment is a run of rows: one sequence's new tokens (attention) or one adapter's tokens (LoRA). Attention
    splits a step that mixes decodes (one token each) with prompts (hundreds) into two groups (length_groups):
    tiles sized for the prompts would spend a 64-row tile, and its programs, on each single decode token. LoRA does
    the same by default (KernelSettings.lora_split); without it, all its segments go together on decode-shaped
    tiles (fewer launches: see tile_len).
    """

    segments: list[tuple[int, int, int, int]]  # (segment g, start row, end row, tag: its adapter for LoRA)
    device: torch.device
    static: StaticBounds | None = None
    _tiles: dict[int, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    @functools.cached_property
    def max_segment_len(self) -> int:
        if self.static is not None:
            return self.static.segment_len
        return max((end - start for _, start, end, _ in self.segments), default=0)

    @functools.cached_property
    def tile_len(self) -> int:
        """The segment length that picks the group's tile shape: the longest segment's, but a group with any
        segment of up to SHORT_SEGMENT rows (a decode) gets decode-shaped tiles, which also serve long segments
        (several tiles each) without spending a prompt-sized tile on each single decode row."""
        if any(end - start <= SHORT_SEGMENT for _, start, end, _ in self.segments):
            return min(self.max_segment_len, SHORT_SEGMENT)
        return self.max_segment_len

    def kind(self, settings: KernelSettings) -> str:
        """What the group's segments are, which picks the LoRA kernels' configs: "decode" (every segment of up to
        SHORT_SEGMENT rows: GEMV kernels), "mixed" (some of them, or all of them but for few adapters with many
        rows each, settings.few_adapters: 16-row tensor-core tiles) or "prompts" (none: prompt-sized tiles). A
        graph's: its bounds', where "short" (graphs of steps with prompts, static_lora.mixed_tiling) is the GEMV
        kernels on tiles of a whole segment of up to SHORT_SEGMENT rows."""
        if self.static is not None:
            return self.static.kind
        if self.max_segment_len <= SHORT_SEGMENT:
            return "mixed" if self.of_few_adapters(settings) else "decode"
        return "mixed" if self.tile_len <= SHORT_SEGMENT else "prompts"

    def of_few_adapters(self, settings: KernelSettings) -> bool:
        """Whether the group's rows belong to few adapters (settings.few_adapters), for LoRA, whose segments are
        adapters."""
        return settings.few_adapters(sum(end - start for _, start, end, _ in self.segments), len(self.segments))

    def tiles(self, block: int) -> torch.Tensor:
        """Tiles of up to `block` rows of one segment, with its tag (see tiles_of), built once."""
        if self.static is not None:
            if block != self.static.tile_block:
                raise ValueError(f"the static tiles were built for {self.static.tile_block}-token tiles, not {block}")
            return self.static.tiles
        if block not in self._tiles:
            self._tiles[block] = tiles_of(self.segments, block, self.device)
        return self._tiles[block]


def length_groups(segments: list[tuple[int, int, int, int]], device: torch.device, split: bool) -> list[SegmentGroup]:
    """The segments as one group, or (split) those of up to SHORT_SEGMENT rows apart from longer ones when the step
    has both kinds."""
    short = [seg for seg in segments if seg[2] - seg[1] <= SHORT_SEGMENT]
    if not split or len(short) in (0, len(segments)):
        return [SegmentGroup(segments, device)]
    return [
        SegmentGroup(short, device),
        SegmentGroup([seg for seg in segments if seg[2] - seg[1] > SHORT_SEGMENT], device),
    ]


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

    # A captured CUDA graph's groups (backend/executor/mixed_graphs.py): static tile buffers refilled before each
    # replay, decodes apart from prompts, instead of groups derived from the step.
    static_groups: list[SegmentGroup] | None = None
    _groups: dict[bool, list[SegmentGroup]] = field(default_factory=dict, repr=False, compare=False)
    # Kernel launches built by the first layer of the step, reused by the others (kernels/triton/paged_attention.py).
    launches: dict[object, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def decode_only(self) -> bool:
        return self.max_q_len == 1

    def tiles(self, block: int) -> torch.Tensor:
        """Query tiles of up to `block` tokens of one sequence (see tiles_of), built once per step."""
        return self.groups(split=False)[0].tiles(block)

    def groups(self, split: bool = True) -> list[SegmentGroup]:
        """The sequences in launch groups (see length_groups): decodes apart from prompts when a step has both."""
        if self.static_groups is not None:
            return self.static_groups
        if split not in self._groups:
            starts = self.q_start_host
            seqs = [(i, starts[i], starts[i + 1], i) for i in range(len(starts) - 1)]
            self._groups[split] = length_groups(seqs, self.q_start.device, split)
        return self._groups[split]


@dataclass(frozen=True)
class StaticBounds:
    """Fixed launch parameters for a captured CUDA graph (backend/executor/cuda_graphs.py).

    A graph replays the grids and buffer shapes it was captured with, so the launchers must not derive them from
    the step: with these bounds, `fused_rank` is max_rank × the modules of the call in `modules` (0 for a call no
    adapter of the graph's steps targets: that call is not launched at all), the kernels' configs are those of
    `kind` and `tiles` is the static buffer, whose unused rows name a null adapter of rank 0 and cover no token.
    """

    max_rank: int  # the largest rank of any module of any adapter (EngineConfig.max_lora_rank)
    tiles: torch.Tensor  # int32 [max_tiles, 4], refilled before each replay
    tile_block: int  # tokens per tile the buffer was built for
    modules: frozenset[int] = frozenset(range(7))  # the only modules any adapter of a replayed step may target
    kind: str = "decode"  # the LoRA kernels' configs (SegmentGroup.kind): "mixed" for steps of few adapters
    # The segment length the launchers pick their configs by (SegmentGroup.max_segment_len): 1 for decode tiles;
    # an attention group of prompts gets a prompt's (above SHORT_SEGMENT: prompt-sized query tiles).
    segment_len: int = 1
    # The tiles the LoRA shrink's K split is planned for (lora_shrink.shrink_grid), when a step of the graph usually
    # fills far fewer than the buffer holds; 0: the buffer's rows. Tiles past the step's exit at once, so planning
    # for all of them would leave the step's own tiles without a K split.
    grid_tiles: int = 0


@dataclass
class LoraMeta:
    """Which adapter each token uses and where that adapter's rows lie in the pool.

    Tokens are grouped so that those of one adapter are contiguous: segment g covers tokens
    seg_start[g]:seg_start[g+1], all using active adapter seg_adapter[g]. Tokens of the base model belong to no
    segment. Module index m follows LORA_MODULES (q, k, v, o, gate, up, down). For active adapter a and module m,
    rows row_start[a, m] .. row_start[a, m] + ranks[a, m] - 1 of a_rows/b_rows give the flat element offsets (in
    one pool layer) of its lora_A rows ([in_features] each) and lora_Bᵀ rows ([out_features] each). An adapter's
    modules follow each other in the row table (row_start[a, m + 1] == row_start[a, m] + ranks[a, m]), so the rows
    of projections fused in one call (q, k, v; gate, up) form one run. Every offset is a multiple of row_align.
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
    row_align: int = 1
    static: StaticBounds | None = None  # set for a CUDA-graph step: launch shapes come from here, not the step
    # A graph's launch groups when it launches decodes apart from prompts (executor/static_lora.py): static tile
    # buffers of their own, refilled before each replay; `static` then holds the rank bound and modules.
    static_groups: list[SegmentGroup] | None = None
    # Built on first use and kept for the step (every layer asks the same): no per-layer Python loops.
    _fused_rank: dict[tuple[int, int], int] = field(default_factory=dict, repr=False, compare=False)
    # Kernel launches built by the first layer of the step, reused by the others (kernels/triton/lora_call.py).
    launches: dict[object, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_segments(self) -> int:
        return len(self.seg_adapter_host)

    def of_few_adapters(self, settings: KernelSettings) -> bool:
        """Whether the step's adapter tokens belong to few adapters (settings.few_adapters): 16-token tensor-core
        tiles."""
        return self.whole().of_few_adapters(settings)

    def targeted_modules(self) -> frozenset[int]:
        """The modules some adapter of the step targets (rank > 0)."""
        return frozenset(m for ranks in self.ranks_host for m, rank in enumerate(ranks) if rank)

    def fused_rank(self, first_module: int, num_modules: int) -> int:
        """The largest total rank of modules first_module .. first_module + num_modules - 1 over the adapters."""
        if self.static is not None:
            targeted = sum(1 for m in range(first_module, first_module + num_modules) if m in self.static.modules)
            return self.static.max_rank * targeted
        key = (first_module, num_modules)
        if key not in self._fused_rank:
            ranks = (sum(r[first_module : first_module + num_modules]) for r in self.ranks_host)
            self._fused_rank[key] = max(ranks, default=0)
        return self._fused_rank[key]

    def tiles(self, block: int) -> torch.Tensor:
        """Token tiles of up to `block` tokens of one segment, tagged with its adapter (see tiles_of)."""
        return self.whole().tiles(block)

    @functools.cached_property
    def _whole(self) -> SegmentGroup:
        if self.static is not None:
            return SegmentGroup([], self.seg_start.device, self.static)
        starts = self.seg_start_host
        segments = [(g, starts[g], starts[g + 1], a) for g, a in enumerate(self.seg_adapter_host)]
        return SegmentGroup(segments, self.seg_start.device)

    def whole(self) -> SegmentGroup:
        """All segments as one group: the LoRA kernels launch decodes and prompts together (see tile_len)."""
        return self._whole

    @functools.cached_property
    def _split(self) -> list[SegmentGroup]:
        return length_groups(self.whole().segments, self.seg_start.device, split=True)

    def groups(self, split: bool) -> list[SegmentGroup]:
        """The groups the LoRA kernels launch: a graph's static groups when it has them (whatever `split`: its
        buffers were filled for them), else the whole step, or (split, not in a CUDA graph) its segments of up to
        SHORT_SEGMENT tokens apart from the longer ones when it has both (length_groups)."""
        if self.static_groups is not None:
            return self.static_groups
        if not split or self.static is not None:
            return [self.whole()]
        return self._split
