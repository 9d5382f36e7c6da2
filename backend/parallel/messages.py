"""Every message between rank 0 (the engine's process, which schedules) and a worker process (a follower rank).

    rank 0 ── channel ──► FollowerSetup  StepMsg  SyncMsg  StopMsg
    rank 0 ◄── channel ── HelloMsg  ReadyMsg  SyncReply  FailedMsg

One channel (a socket pair) per follower, pickled by multiprocessing.connection; the tensors of a step travel
through the group's collectives instead (collectives.py), and so do the step's input tokens, which may still be
on the device under overlapped steps. A follower's pool replays rank 0's allocations in order (pool_mirror.py),
so the events say only what rank 0 did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from slora.backend.config import EngineConfig
from slora.backend.memory.page_pool import Owner, PageKind
from slora.backend.parallel.adapter_shard import Fingerprint

AdapterKey = tuple[str, int]


# ---- page pool events, in rank 0's order ----------------------------------------------------------------------


@dataclass(frozen=True)
class PoolAlloc:
    kind: PageKind
    owner: Owner
    pages: tuple[int, ...]  # what rank 0's pool handed out: the follower's must hand out the same


@dataclass(frozen=True)
class PoolFree:
    owner: Owner
    pages: tuple[int, ...]


@dataclass(frozen=True)
class AdapterCopy:
    """An adapter was made resident in `pages` (just allocated): copy this rank's rows of it into them."""

    key: AdapterKey
    path: str
    fingerprint: Fingerprint  # of the weights file rank 0 read: a follower reading another file refuses
    pages: tuple[int, ...]


PoolEvent: TypeAlias = PoolAlloc | PoolFree | AdapterCopy


# ---- a step ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepPlan:
    """What a forward needs beyond the input tokens, as host lists (rank 0's ForwardBatch, batch.py)."""

    q_start: list[int]  # [num_seqs + 1]: each sequence's first row
    seq_lens: list[int]  # [num_seqs]: context length, this step's tokens included
    block_tables: list[list[int]]  # pool pages of each sequence's context
    sample_rows: list[int]  # rows whose logits are sampled
    seg_start: list[int]  # LoRA segments (empty: no adapter token)
    seg_adapter: list[int]
    adapters: list[AdapterKey]  # the step's adapters, in the segments' numbering

    @property
    def num_tokens(self) -> int:
        return self.q_start[-1]


# ---- rank 0 → follower ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FollowerSetup:
    config: EngineConfig
    rank: int
    size: int
    store_port: int  # rank 0's TCPStore, where the group meets


@dataclass(frozen=True)
class StepMsg:
    events: list[PoolEvent]
    plan: StepPlan


@dataclass(frozen=True)
class SyncMsg:
    """Replay `events`, check the pool, and compare its page table with rank 0's (`digest`)."""

    events: list[PoolEvent]
    digest: str


@dataclass(frozen=True)
class StopMsg:
    pass


ToFollower: TypeAlias = FollowerSetup | StepMsg | SyncMsg | StopMsg


# ---- follower → rank 0 -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HelloMsg:
    rank: int
    pid: int


@dataclass(frozen=True)
class ReadyMsg:
    rank: int


@dataclass(frozen=True)
class SyncReply:
    rank: int
    error: str | None  # why the rank's pool failed its check; None: it passed


@dataclass(frozen=True)
class FailedMsg:
    rank: int
    reason: str  # the exception that ends the follower


FromFollower: TypeAlias = HelloMsg | ReadyMsg | SyncReply | FailedMsg
