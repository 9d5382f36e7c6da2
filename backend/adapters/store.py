"""The host adapter store: which adapters exist (registry + adapter root) and which are in host memory.

Adapters are loaded lazily from disk on first use and kept in host memory up to a byte budget, least recently used
first out (copies to the GPU go through a page-locked staging buffer, see adapter_cache.py). A request holds a
reference to its HostAdapter, so dropping an adapter from the store never pulls weights from under a queued
request; the next request reloads it.

Names come from clients, so they are checked: letters, digits, '_', '.', '-', not starting with '.', and the
resolved directory must lie inside the adapter root (no '..', no symlink escaping it). Adapters registered by path
(multi_lora.json, or `register`) are trusted operator input and may live anywhere.

Thread-safe: the server registers and looks up adapters from request threads while the engine thread runs.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from slora.backend.adapters.host_adapter import CONFIG_FILE, HostAdapter
from slora.backend.errors import AdapterError, AdapterNotFoundError

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
ROOT_LISTING_TTL_S = 10.0  # the adapter root is listed at most this often for statistics
MAX_PRELOAD_WORKERS = 8  # preload's threads at most (their Python work shares the GIL)

AdapterLoader = Callable[[str, Path, int], HostAdapter]


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str
    in_host: bool
    ranks: dict[str, int] | None  # None until the adapter has been loaded once


def preload_workers() -> int:
    """Threads for AdapterStore.preload: one per core this process may use, at most MAX_PRELOAD_WORKERS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_PRELOAD_WORKERS, cores))


@contextmanager
def _intra_op_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to `count` for this thread and threads started within, restored after.

    torch.set_num_threads is process-wide: meant for start-up, before other threads run tensor work.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def validate_adapter_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise AdapterError(
            f"adapter name {name!r} is invalid: use 1-128 letters, digits, '_', '.', '-', not starting with '.'"
        )
    return name


class AdapterStore:
    def __init__(
        self,
        loader: AdapterLoader,
        budget_bytes: int,
        root: str | Path | None = None,
        registry_file: str | Path | None = None,
    ) -> None:
        self._loader = loader
        self.budget_bytes = budget_bytes
        self.root = Path(root).resolve() if root else None
        self._lock = threading.Lock()
        self._registered: dict[str, Path] = {}
        self._generation: dict[str, int] = {}
        self._host: OrderedDict[str, HostAdapter] = OrderedDict()
        self._ranks: dict[str, dict[str, int]] = {}
        self.host_bytes = 0
        self.loads = 0
        self.host_evictions = 0
        self.load_waits = 0  # gets that waited for another thread's read of the same adapter
        self._loading: dict[tuple[str, int], Future[HostAdapter]] = {}
        self._root_names: frozenset[str] = frozenset()
        self._root_listed_at = -float("inf")
        if registry_file:
            self.register_file(Path(registry_file))

    def register_file(self, registry_file: Path) -> None:
        """Register every name → path of a multi_lora.json (the format Triton's vLLM backend reads)."""
        try:
            entries = json.loads(registry_file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise AdapterError(f"{registry_file}: cannot be read as JSON ({exc})") from exc
        if not isinstance(entries, dict):
            raise AdapterError(f"{registry_file}: must hold a JSON object of adapter name → directory")
        for name, path in entries.items():
            target = Path(path) if Path(path).is_absolute() else registry_file.parent / path
            self.register(name, target, load=False)

    def register(self, name: str, path: str | Path, load: bool = True) -> HostAdapter | None:
        """Add or replace `name` → `path`. With `load`, the adapter is read now so that a bad one is refused."""
        validate_adapter_name(name)
        path = Path(path)
        if not (path / CONFIG_FILE).is_file():
            raise AdapterError(f"adapter {name!r}: {path / CONFIG_FILE} is missing")
        with self._lock:
            generation = self._generation.get(name, 0) + 1
        adapter = self._loader(name, path, generation) if load else None
        with self._lock:
            self._registered[name] = path
            self._generation[name] = generation
            self._drop(name)
            if adapter is not None:
                self._insert(adapter)
        logger.info("registered adapter %r at %s", name, path)
        return adapter

    def unregister(self, name: str) -> None:
        """Forget a registered adapter; requests already holding it finish with it."""
        with self._lock:
            if name not in self._registered:
                raise AdapterNotFoundError(f"adapter {name!r} is not registered")
            del self._registered[name]
            self._generation[name] = self._generation.get(name, 0) + 1
            self._drop(name)
            self._ranks.pop(name, None)

    def in_host(self, name: str) -> bool:
        """Whether `get(name)` would return without reading the disk."""
        with self._lock:
            return name in self._host

    def get(self, name: str) -> HostAdapter:
        """The adapter in host memory, loading it from disk if needed (in the caller's thread). Callers that ask for
        an adapter another thread is reading wait for that read and get its adapter (or its error): one disk read
        per adapter, however many requests for it arrive together."""
        validate_adapter_name(name)
        with self._lock:
            adapter = self._host.get(name)
            if adapter is not None:
                self._host.move_to_end(name)
                return adapter
            path = self._path(name)
            generation = self._generation.get(name, 0)
            pending = self._loading.get((name, generation))
            if pending is None:
                self._loading[(name, generation)] = loading = Future[HostAdapter]()
            else:
                self.load_waits += 1
        if pending is not None:
            return pending.result()
        return self._load(name, path, generation, loading)

    def _load(self, name: str, path: Path, generation: int, loading: Future[HostAdapter]) -> HostAdapter:
        """Read the adapter, keep it unless re-registered meanwhile, and hand it (or the error) to the waiters."""
        try:
            adapter = self._loader(name, path, generation)
            with self._lock:
                del self._loading[(name, generation)]
                if self._generation.get(name, 0) == generation:
                    self._drop(name)
                    self._insert(adapter)
        except BaseException as exc:
            with self._lock:
                self._loading.pop((name, generation), None)
            loading.set_exception(exc)
            raise
        loading.set_result(adapter)
        return adapter

    def preload(self, workers: int | None = None, names: list[str] | None = None) -> int:
        """Load every known adapter (or those of `names`) into host memory, `workers` threads at a time (default:
        one per core, at most MAX_PRELOAD_WORKERS); stops adding beyond the budget. Returns count.

        The loads run their tensor operations on one intra-op thread each: spread over torch's intra-op threads,
        every operation waits for all of them, so one core busy with anything else stalls each of them (3-10x
        slower loads on a shared 2-core machine), and several loading threads would oversubscribe the cores.
        """
        wanted = None if names is None else set(names)
        names = [info.name for info in self.list() if not info.in_host and (wanted is None or info.name in wanted)]
        workers = preload_workers() if workers is None else max(1, workers)
        loaded, start = 0, time.monotonic()
        with _intra_op_threads(1), ThreadPoolExecutor(max_workers=workers) as pool:
            for name, error in zip(names, pool.map(self._try_get, names)):
                if error:
                    logger.warning("preload: adapter %r skipped: %s", name, error)
                else:
                    loaded += 1
        logger.info("preloaded %d adapters into host memory (%d bytes) in %.1f s with %d threads", loaded,
                    self.host_bytes, time.monotonic() - start, workers)  # fmt: skip
        return loaded

    def _try_get(self, name: str) -> str | None:
        try:
            self.get(name)
        except AdapterError as exc:
            return str(exc)
        return None

    def list(self) -> list[AdapterInfo]:
        """Every adapter known by registration or found in the adapter root (listed now), sorted by name."""
        root_names = self._list_root(max_age_s=0.0)
        with self._lock:
            names = set(self._registered) | set(self._host) | root_names
            return [
                AdapterInfo(name, str(self._path(name)), name in self._host, self._ranks.get(name))
                for name in sorted(names)
            ]

    def counts(self) -> tuple[int, int]:
        """(adapters in host memory, adapters known); the root listing may be up to ROOT_LISTING_TTL_S old."""
        root_names = self._list_root(max_age_s=ROOT_LISTING_TTL_S)
        with self._lock:
            return len(self._host), len(set(self._registered) | set(self._host) | root_names)

    def _list_root(self, max_age_s: float) -> frozenset[str]:
        now = time.monotonic()
        if now - self._root_listed_at <= max_age_s:
            return self._root_names
        names: frozenset[str] = frozenset()
        if self.root and self.root.is_dir():
            names = frozenset(
                p.name for p in self.root.iterdir() if _NAME.match(p.name) and (p / CONFIG_FILE).is_file()
            )
        self._root_names, self._root_listed_at = names, now
        return names

    def _path(self, name: str) -> Path:
        if name in self._registered:
            return self._registered[name]
        if self.root is not None:
            path = (self.root / name).resolve()
            if not path.is_relative_to(self.root):
                raise AdapterError(f"adapter name {name!r} resolves outside the adapter root")
            if path.is_dir():
                return path
        raise AdapterNotFoundError(f"adapter {name!r} is not registered and not found in the adapter root")

    def _insert(self, adapter: HostAdapter) -> None:
        if adapter.nbytes > self.budget_bytes:
            raise AdapterError(
                f"adapter {adapter.name!r} needs {adapter.nbytes} bytes of host memory, more than the whole "
                f"host budget ({self.budget_bytes} bytes)"
            )
        self._host[adapter.name] = adapter
        self._ranks[adapter.name] = dict(zip(adapter.target_modules, [r for r in adapter.ranks if r]))
        self.host_bytes += adapter.nbytes
        self.loads += 1
        while self.host_bytes > self.budget_bytes:
            victim, _ = next(iter(self._host.items()))
            self._drop(victim)
            self.host_evictions += 1
            logger.info("host budget: dropped adapter %r from host memory", victim)

    def _drop(self, name: str) -> None:
        adapter = self._host.pop(name, None)
        if adapter is not None:
            self.host_bytes -= adapter.nbytes
