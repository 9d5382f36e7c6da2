"""A tensor-parallel worker process: rank i of n, following rank 0's steps (started by workers.py).

    python -m slora.backend.parallel.follower FD      FD: its end of the channel to rank 0

It builds its shard and pool as rank 0 does (startup.build_shard), then for each message: replays rank 0's pool
events (pool_mirror.py; copying its rows of each adapter made resident into the same pages), runs the step's
forward (decoder.ShardedDecoder.follow) or checks its pool. It never decides anything. Its adapters come from
disk when rank 0 first makes them resident, and stay in host memory (least recently used out past
host_budget_bytes) for the next time. It exits when rank 0 says so, when the channel closes, or when its parent
is gone; an error it cannot go on from is sent to rank 0 (FailedMsg) before it exits.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import torch

from slora.backend.config import EngineConfig
from slora.backend.errors import AdapterError
from slora.backend.memory.page_pool import PoolIntegrityError
from slora.backend.model.default_model import resolve_model_path
from slora.backend.model.spec import ModelSpec
from slora.backend.parallel.adapter_shard import ShardedHostAdapter, load_adapter_shard, weights_fingerprint
from slora.backend.parallel.collectives import Collectives, join_store
from slora.backend.parallel.decoder import ShardedDecoder
from slora.backend.parallel.layout import ShardPlan, rank_device
from slora.backend.parallel.lora import AdapterKey, ShardRows
from slora.backend.parallel.messages import (
    AdapterCopy,
    FailedMsg,
    FollowerSetup,
    HelloMsg,
    PoolEvent,
    PoolFree,
    ReadyMsg,
    StepMsg,
    StopMsg,
    SyncMsg,
    SyncReply,
)
from slora.backend.parallel.pool_mirror import MirroredPagePool
from slora.backend.parallel.startup import build_shard
from slora.backend.parallel.step_plan import batch_of
from slora.backend.stub_compat import hide_packages_broken_by_numpy

logger = logging.getLogger(__name__)

PARENT_POLL_S = 1.0


class ShardCache:
    """A follower's adapters: its shards in host memory (LRU within the budget), and those resident in its pool."""

    def __init__(self, config: EngineConfig, plan: ShardPlan, pool: MirroredPagePool) -> None:
        self.config = config
        self.plan = plan
        self.pool = pool
        self._host: OrderedDict[AdapterKey, ShardedHostAdapter] = OrderedDict()
        self._resident: dict[AdapterKey, ShardRows] = {}

    def copy_in(self, event: AdapterCopy) -> None:
        """Copy this rank's rows of the adapter into the pages rank 0 gave it (this pool's, just replayed)."""
        host = self._shard(event)
        if host.num_pages != len(event.pages):
            raise PoolIntegrityError(
                f"adapter {event.key[0]!r} takes {host.num_pages} pages here, {len(event.pages)} on rank 0"
            )
        pool = self.pool
        pages = torch.tensor(event.pages, dtype=torch.int64)
        pool.storage[:, pages.to(pool.storage.device)] = host.image.to(pool.storage.device)
        self._resident[event.key] = ShardRows.of(host, *_pool_rows(host, pages.numpy(), pool.geometry.page_elems))

    def drop(self, key: AdapterKey) -> None:
        self._resident.pop(key, None)

    def rows(self, keys: list[AdapterKey]) -> list[ShardRows]:
        return [self._resident[key] for key in keys]

    def _shard(self, event: AdapterCopy) -> ShardedHostAdapter:
        host = self._host.get(event.key)
        if host is None or host.fingerprint != event.fingerprint:  # unknown, or read before the file changed
            host = self._read(event)
        self._host[event.key] = host
        self._host.move_to_end(event.key)
        while sum(h.nbytes for h in self._host.values()) > self.config.host_budget_bytes and len(self._host) > 1:
            self._host.popitem(last=False)
        return host

    def _read(self, event: AdapterCopy) -> ShardedHostAdapter:
        name, generation = event.key
        path = Path(event.path)
        found = weights_fingerprint(path)
        if found != event.fingerprint:
            raise AdapterError(
                f"adapter {name!r}: the weights file in {path} is not the one rank 0 read (size, mtime {found} here, "
                f"{event.fingerprint} there): it was rewritten in place; register the adapter again"
            )
        c = self.config
        return load_adapter_shard(name, path, self.plan, self.pool.geometry, self.pool.storage.dtype,
                                  max_rank=c.max_lora_rank, generation=generation)  # fmt: skip


class Follower:
    """One follower rank's parts and its message loop (see top)."""

    def __init__(self, setup: FollowerSetup, model: ShardedDecoder, pool: MirroredPagePool) -> None:
        self.rank = setup.rank
        self.model = model
        self.pool = pool
        self.adapters = ShardCache(setup.config, model.plan, pool)

    @classmethod
    def build(cls, setup: FollowerSetup) -> Follower:
        config = setup.config
        base = config.torch_device()
        device = rank_device(base, setup.rank)
        if device.type == "cpu":  # the ranks share the host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // setup.size))
        comm = Collectives.connect(join_store(setup.store_port, setup.size), setup.rank, setup.size, device)
        model_path = resolve_model_path(config.model)  # rank 0 resolved (and converted) it already
        plan = ShardPlan(ModelSpec.from_dir(model_path), setup.size, setup.rank)
        model, pool = build_shard(config, model_path, plan, device, config.torch_dtype(base), comm, record=False)
        return cls(setup, model, pool)

    def serve(self, conn: Connection) -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                logger.info("rank 0 closed the channel; rank %d exits", self.rank)
                return
            if isinstance(message, StepMsg):
                self._replay(message.events)
                self._step(message)
            elif isinstance(message, SyncMsg):
                self._replay(message.events)
                conn.send(SyncReply(self.rank, self._check(message.digest)))
            elif isinstance(message, StopMsg):
                return

    def _replay(self, events: list[PoolEvent]) -> None:
        for event in events:
            if isinstance(event, AdapterCopy):
                self.adapters.copy_in(event)
                continue
            self.pool.replay(event)
            if isinstance(event, PoolFree) and event.owner[0] == "adapter":
                self.adapters.drop(event.owner[1])

    def _step(self, message: StepMsg) -> None:
        plan = message.plan
        batch = batch_of(plan, self.pool.geometry.block_size, self.pool.storage.device)
        self.model.follow(plan, batch, self.adapters.rows(plan.adapters), self.pool)

    def _check(self, digest: str) -> str | None:
        try:
            self.pool.check_integrity()
        except PoolIntegrityError as exc:
            return str(exc)
        return None if self.pool.digest() == digest else "its page table differs from rank 0's"


def _pool_rows(host: ShardedHostAdapter, pages: np.ndarray, page_elems: int) -> tuple[np.ndarray, np.ndarray]:
    """The flat pool offsets of the shard's A and Bᵀ rows in `pages` (as AdapterCache._copy_in places them)."""
    a_local, b_local = host.a_local.numpy(), host.b_local.numpy()
    a_rows = pages[a_local // page_elems] * page_elems + a_local % page_elems
    b_rows = pages[b_local // page_elems] * page_elems + b_local % page_elems
    return a_rows, b_rows


def _watch_parent() -> None:
    """Exit when rank 0's process is gone (this process is re-parented), even if blocked in a collective."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="slora-tp-parent", daemon=True).start()


def _configure_logging(rank: int) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"slora tensor-parallel rank {rank} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("slora")
    root.handlers = [handler]
    root.setLevel(logging.WARNING)
    root.propagate = False


def main(fd: int) -> None:
    conn = Connection(fd)
    setup: FollowerSetup = conn.recv()
    _configure_logging(setup.rank)
    hide_packages_broken_by_numpy()
    _watch_parent()
    conn.send(HelloMsg(setup.rank, os.getpid()))
    try:
        follower = Follower.build(setup)
        conn.send(ReadyMsg(setup.rank))
        follower.serve(conn)
    except Exception as exc:
        logger.exception("tensor-parallel rank %d failed", setup.rank)
        try:
            conn.send(FailedMsg(setup.rank, f"{type(exc).__name__}: {exc}"))
        except (OSError, ValueError):
            pass
        sys.exit(1)


if __name__ == "__main__":
    main(int(sys.argv[1]))
