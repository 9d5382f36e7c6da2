"""The host adapter store: which adapters exist (registry + adapter root) and which are in host memory.

Adapters are read from disk on first use and kept in host memory up to a byte budget, least recently used first
out (copies to the GPU go through a page-locked staging buffer, see adapter_cache.py). A queued request holds only
its adapter's AdapterRef (name, generation, path, ranks, pages, bytes: `describe`, from the config and the
safetensors header when the store has a describer), so a long queue pins no host memory; the scheduler asks for
the weights when it reads ahead or admits the request (`fetch`: a read on one of the store's reader threads, never
on the engine's). A ref names the path and generation it was described at, so a request queued before its name
was registered again or removed is served the adapter it was taken in with (while its files are there).

The tiers, top down: the pool (adapter_cache.py), host memory (this store's budget), converted page images on
local disk (image_cache.py, memory-mapped: the OS page cache sits below host memory), the PEFT files themselves.

Names come from clients, so they are checked: letters, digits, '_', '.', '-', not starting with '.', no '..',
and an adapter of the root must lie inside it: neither its folder nor the files read from it may be symlinks that
lead out of the root. Adapters registered by path (multi_lora.json, or `register`) are trusted operator input and
may live anywhere. A bad entry of the root (a symlink out of it, a name no client can send) is skipped by the
listing and logged once as a warning, never failing the listing of the others; `bad_entries` says which and why.

A name is registered once: `register` of a name already registered or present under the root raises
AdapterExistsError unless `replace=True`.

Thread-safe: the server registers and looks up adapters from request threads while the engine thread runs.
"""

from __future__ import annotations

import contextlib
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
from typing import Any, Protocol

import torch

from slora.backend.adapters.host_adapter import CONFIG_FILE, WEIGHTS_FILE, AdapterRef, HostAdapter
from slora.backend.errors import AdapterError, AdapterExistsError, AdapterNotFoundError

logger = logging.getLogger(__name__)

# Used with fullmatch: with match and `$`, a name with a trailing newline passed.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)  # what the loader reads from an adapter's folder
ROOT_LISTING_TTL_S = 10.0  # the adapter root is listed at most this often for statistics
MAX_PRELOAD_WORKERS = 8  # preload's threads at most (their Python work shares the GIL)
_BUDGET_FULL = "host budget full"  # preload's mark of an adapter left on disk
READER_THREADS = 4  # fetch's reads at once (disk reads, and conversions where the image cache has none)

AdapterLoader = Callable[[str, Path, int], HostAdapter]  # (name, path, generation) → the adapter, read and checked
AdapterDescriber = Callable[[str, Path, int], AdapterRef]  # the same arguments → its ref, without the weights


class Submitter(Protocol):
    """Where fetch runs its reads: a ThreadPoolExecutor, or (servers) runtime's FreshThreadExecutor."""

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future[Any]: ...


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
    """`name` if clients may send it: 1-128 letters, digits, '_', '.', '-', not starting with '.', without '..'
    (so no path separator, control character or whitespace); raises AdapterError naming it otherwise."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise AdapterError(
            f"adapter name {name!r} is invalid: use 1-128 letters, digits, '_', '.', '-', not starting with '.' "
            "and without '..'"
        )
    return name


class AdapterStore:
    def __init__(
        self,
        loader: AdapterLoader,
        budget_bytes: int,
        root: str | Path | None = None,
        registry_file: str | Path | None = None,
        describer: AdapterDescriber | None = None,
        readers: Submitter | None = None,
    ) -> None:
        """`describer`: refs without reading the weights (without it, `describe` reads the adapter). `readers`: where
        `fetch` reads (default: a pool of READER_THREADS threads)."""
        self._loader = loader
        self._describer = describer
        self._readers: Submitter = readers or ThreadPoolExecutor(READER_THREADS, thread_name_prefix="slora-read")
        self.budget_bytes = budget_bytes
        self.root = Path(root).resolve() if root else None
        self._lock = threading.Lock()
        self._registered: dict[str, Path] = {}
        self._generation: dict[str, int] = {}
        self._host: OrderedDict[str, HostAdapter] = OrderedDict()
        self._ranks: dict[str, dict[str, int]] = {}
        self._refs: dict[str, AdapterRef] = {}  # name → its ref at its current generation
        self.host_bytes = 0
        self.loads = 0
        self.host_evictions = 0
        self.load_waits = 0  # gets that waited for another thread's read of the same adapter
        self._loading: dict[tuple[str, int], Future[HostAdapter]] = {}
        self._root_entries: dict[str, Path] = {}  # name → folder, as of the last listing of the root
        self._root_listed_at = -float("inf")
        self._relisting = False  # a listing of the root for `counts` is under way in its own thread
        self._bad_entries: dict[str, str] = {}  # name → why it is skipped, as of the last listing of the root
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
            # The operator's file: its names take precedence over folders of the adapter root, as they always did
            self.register(name, target, load=False, replace=True)
        logger.info("registered %d adapters from %s", len(entries), registry_file)

    def register(self, name: str, path: str | Path, load: bool = True, replace: bool = False) -> HostAdapter | None:
        """Register `name` → `path`. With `load`, the adapter is read now so that a bad one is refused (and nothing
        changes). A name already registered or present under the adapter root raises AdapterExistsError unless
        `replace`: then requests after this one get the new adapter, requests already taken in keep the old one (their
        refs name its path and generation)."""
        validate_adapter_name(name)
        path = Path(path)
        if not (path / CONFIG_FILE).is_file():
            raise AdapterError(f"adapter {name!r}: {path / CONFIG_FILE} is missing")
        with self._lock:
            if not replace:
                self._refuse_existing(name, path)
            generation = self._generation.get(name, 0) + 1
        adapter = self._loader(name, path, generation) if load else None
        with self._lock:
            if not replace:
                self._refuse_existing(name, path)  # registered by another thread while this one read the disk
            self._registered[name] = path
            self._generation[name] = generation
            self._drop(name)
            self._refs.pop(name, None)
            self._ranks.pop(name, None)
            if adapter is not None:
                self._insert(adapter)
        logger.debug("registered adapter %r at %s", name, path)
        return adapter

    def path_of(self, name: str) -> Path | None:
        """Where `name` is registered, else its entry under the adapter root if there is one (even a bad one),
        else None; never raises."""
        with self._lock:
            registered = self._registered.get(name)
        if registered is not None:
            return registered
        return self.root / name if self.root is not None and self.in_root(name) else None

    def _refuse_existing(self, name: str, path: Path) -> None:
        """Raise AdapterExistsError if `name` is registered or an entry of the root (call with the lock held)."""
        existing = self._registered.get(name)
        if existing is None and self.root is not None and os.path.lexists(self.root / name):
            existing = self.root / name
        if existing is not None:
            raise AdapterExistsError(
                f"adapter {name!r} already exists ({existing}); registering it at {path} would re-point it: "
                "load it with replace=true to do that"
            )

    def unregister(self, name: str) -> Path:
        """Forget a registered adapter and return where it was; requests already holding it finish with it."""
        with self._lock:
            if name not in self._registered:
                raise AdapterNotFoundError(f"adapter {name!r} is not registered")
            path = self._registered.pop(name)
            self._generation[name] = self._generation.get(name, 0) + 1
            self._drop(name)
            self._ranks.pop(name, None)
            self._refs.pop(name, None)
        return path

    def in_root(self, name: str) -> bool:
        """Whether the adapter root has an entry `name` (good or bad); never raises."""
        return self.root is not None and validate_name_quietly(name) and os.path.lexists(self.root / name)

    def in_host(self, name: str) -> bool:
        """Whether `get(name)` would return without reading the disk."""
        with self._lock:
            return name in self._host

    def describe(self, name: str) -> AdapterRef:
        """The ref of `name` at its current generation (what a queued request holds): from memory when known, else
        from its config and safetensors header (the describer; without one, by reading the adapter as `get` does).
        Raises AdapterError (AdapterNotFoundError) as `get` does."""
        validate_adapter_name(name)
        with self._lock:
            known = self._refs.get(name)
            if known is not None:
                return known
            path = self._path(name)
            generation = self._generation.get(name, 0)
        if self._describer is None:
            return self.get(name).ref
        ref = self._describer(name, path, generation)
        with self._lock:
            if self._generation.get(name, 0) == generation:  # not registered again meanwhile
                self._refs[name] = ref
                self._ranks[name] = _rank_map(ref.target_modules, ref.ranks)
        return ref

    def is_described(self, name: str) -> bool:
        """Whether `describe(name)` would return without reading the disk."""
        with self._lock:
            return name in self._refs

    def reads_on_intake(self, name: str) -> bool:
        """Whether taking in a request for `name` (describe, then read_if_room) may read the disk: it is not
        described yet, or not in host memory while the budget has room for it."""
        with self._lock:
            ref = self._refs.get(name)
            if ref is None:
                return True
            held = self._host.get(name)
            if held is not None and held.generation == ref.generation:
                return False
            return self.host_bytes + ref.nbytes <= self.budget_bytes

    def lookup(self, ref: AdapterRef) -> HostAdapter | None:
        """`ref`'s adapter if host memory holds it (marked as just used), else None; never reads."""
        with self._lock:
            adapter = self._host.get(ref.name)
            if adapter is None or adapter.generation != ref.generation:
                return None
            self._host.move_to_end(ref.name)
            return adapter

    def fetch(self, ref: AdapterRef) -> Future[HostAdapter]:
        """`ref`'s adapter in host memory: a done Future when it is there, else one that a reader thread completes
        with the adapter (kept in host memory unless its name was registered again) or the read's error. Never
        blocks; one read per adapter however many ask at once (`get`'s reads included)."""
        adapter = self.lookup(ref)
        if adapter is not None:
            return _done(adapter)
        with self._lock:
            pending = self._loading.get(ref.key)
            if pending is not None:
                return pending
            self._loading[ref.key] = loading = Future[HostAdapter]()
        try:
            self._readers.submit(self._read, [(ref, loading)])
        except RuntimeError as exc:  # the readers were shut down: the engine is stopping
            with self._lock:
                self._loading.pop(ref.key, None)
            loading.set_exception(AdapterError(f"adapter {ref.name!r} cannot be read: {exc}"))
        return loading

    def read_if_room(self, ref: AdapterRef) -> bool:
        """Read `ref`'s adapter into host memory now (waiting for the read) if the budget has room for it without
        dropping another; returns whether it is in host memory. While memory has room, a request's adapter is read
        when it is taken in (on the intake's thread); beyond that, reads follow the queue (the scheduler's
        read-ahead), so that adapters of requests far back in a long queue do not push out those of the next ones.
        Raises the read's error."""
        if self.lookup(ref) is not None:
            return True
        with self._lock:
            if self.host_bytes + ref.nbytes > self.budget_bytes:
                return False
        self.fetch(ref).result()
        return True

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

    def _read(self, task: list[tuple[AdapterRef, Future[HostAdapter]]]) -> None:
        """fetch's read, on a reader thread: its result or error goes to the task's Future (and so to whoever
        waits). The task is emptied first: an executor may keep its last task's arguments after running it
        (FreshThreadExecutor's dispatcher does, until the next one), and they must not keep the adapter alive."""
        ref, loading = task.pop()
        with contextlib.suppress(Exception):
            self._load(ref.name, ref.path, ref.generation, loading)

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
        one per core, at most MAX_PRELOAD_WORKERS); stops once the budget is full (the rest stay on disk, read
        when first used, instead of being read only to push out the ones read before them). Returns count.

        The loads run their tensor operations on one intra-op thread each: spread over torch's intra-op threads,
        every operation waits for all of them, so one core busy with anything else stalls each of them (3-10x
        slower loads on a shared 2-core machine), and several loading threads would oversubscribe the cores.
        """
        wanted = None if names is None else set(names)
        names = [info.name for info in self.list() if not info.in_host and (wanted is None or info.name in wanted)]
        workers = preload_workers() if workers is None else max(1, workers)
        loaded, left, start = 0, 0, time.monotonic()
        with _intra_op_threads(1), ThreadPoolExecutor(max_workers=workers) as pool:
            for name, error in zip(names, pool.map(self._try_preload, names)):
                if error is _BUDGET_FULL:
                    left += 1
                elif error:
                    logger.warning("preload: adapter %r skipped: %s", name, error)
                else:
                    loaded += 1
        logger.info("preloaded %d adapters into host memory (%d bytes) in %.1f s with %d threads", loaded,
                    self.host_bytes, time.monotonic() - start, workers)  # fmt: skip
        if left:
            logger.info("preload: the host budget (%d bytes) is full; %d adapters stay on disk until used",
                        self.budget_bytes, left)  # fmt: skip
        return loaded

    def _try_preload(self, name: str) -> str | None:
        """None when read, _BUDGET_FULL when left on disk (it would push out another), else why it was skipped."""
        if self.host_bytes >= self.budget_bytes:
            return _BUDGET_FULL
        try:
            size = self.describe(name).nbytes if self._describer is not None else 0
            if self.host_bytes + size > self.budget_bytes:
                return _BUDGET_FULL
            self.get(name)
        except AdapterError as exc:
            return str(exc)
        return None

    def list(self) -> list[AdapterInfo]:
        """Every adapter known by registration, in host memory or found in the adapter root (listed now), sorted
        by name. Bad entries of the root are left out (see `bad_entries`)."""
        root = self._list_root()
        with self._lock:
            # A registration shadows a folder of the same name; an adapter in host memory is listed even if its
            # folder has gone since it was read.
            paths = {**root, **{name: a.path for name, a in self._host.items()}, **self._registered}
            return [
                AdapterInfo(name, str(path), name in self._host, self._ranks.get(name))
                for name, path in sorted(paths.items())
            ]

    def bad_entries(self) -> dict[str, str]:
        """Entries of the adapter root that the last listing skipped: name → why."""
        with self._lock:
            return dict(self._bad_entries)

    def counts(self) -> tuple[int, int]:
        """(adapters in host memory, adapters known). The engine thread asks after every step, and listing a root
        of thousands of folders takes tens of milliseconds: only the first listing is made here, an older one than
        ROOT_LISTING_TTL_S is then redone in a thread of its own and counted once done."""
        if self._root_listed_at == -float("inf"):
            self._list_root()
        elif time.monotonic() - self._root_listed_at > ROOT_LISTING_TTL_S:
            self._relist_in_background()
        with self._lock:
            return len(self._host), len(self._registered.keys() | self._host.keys() | self._root_entries.keys())

    def _relist_in_background(self) -> None:
        with self._lock:
            if self._relisting:
                return
            self._relisting = True
        threading.Thread(target=self._relist, name="slora-root-listing", daemon=True).start()

    def _relist(self) -> None:
        try:
            self._list_root()
        finally:
            with self._lock:
                self._relisting = False

    def _list_root(self) -> dict[str, Path]:
        """name → folder of every good adapter of the root, listed now; bad entries are recorded and warned of once.
        A listing started before the one kept (a background one overtaken by `list`) is not kept."""
        now = time.monotonic()
        entries, bad = self._scan_root()
        with self._lock:
            if now < self._root_listed_at:
                return entries
            for name, reason in bad.items():
                if self._bad_entries.get(name) != reason:
                    logger.warning("adapter root: entry %r skipped: %s", name, reason)
            self._root_entries, self._bad_entries, self._root_listed_at = entries, bad, now
        return entries

    def _scan_root(self) -> tuple[dict[str, Path], dict[str, str]]:
        """(name → folder of the good adapters, name → why of the bad entries) of the adapter root, now."""
        entries: dict[str, Path] = {}
        bad: dict[str, str] = {}
        if self.root is None or not self.root.is_dir():
            return entries, bad
        try:
            names = [p.name for p in self.root.iterdir()]
        except OSError as exc:
            return entries, {str(self.root): f"the adapter root cannot be listed ({exc})"}
        for name in names:
            if name.startswith("."):
                continue  # hidden (.git, .cache): never an adapter name, and not worth a warning
            try:
                folder = self._root_folder(name)
                if folder is None or not (folder / CONFIG_FILE).is_file():
                    continue  # not an adapter (a file, an empty folder)
                validate_adapter_name(name)
            except (AdapterError, OSError) as exc:
                bad[name] = str(exc)
                continue
            entries[name] = folder
        return entries, bad

    def _root_folder(self, name: str) -> Path | None:
        """The folder of root entry `name`, or None if it is not a folder; raises AdapterError if it, or a file
        the loader reads from it, is a symlink that leads out of the root (registered adapters are not held)."""
        assert self.root is not None
        try:
            folder = self._confined(name, self.root / name)
            if not folder.is_dir():
                return None
            for file in ADAPTER_FILES:
                self._confined(name, folder / file)
        except OSError as exc:  # permission denied, mostly: this entry is unusable, the others are not
            raise AdapterError(f"adapter {name!r}: {self.root / name} cannot be read ({exc})") from exc
        return folder

    def _confined(self, name: str, path: Path) -> Path:
        """`path` resolved, if it is a symlink; raises AdapterError if that leads out of the root."""
        assert self.root is not None
        if not path.is_symlink():
            return path  # the root is resolved and names hold no separator: a plain entry is inside it
        try:
            target = path.resolve()
        except (OSError, RuntimeError) as exc:  # a symlink loop
            raise AdapterError(f"adapter {name!r}: {path} cannot be resolved ({exc})") from exc
        if not target.is_relative_to(self.root):
            raise AdapterError(f"adapter {name!r}: {path} is a symlink to {target}, outside the adapter root")
        return target

    def _path(self, name: str) -> Path:
        if name in self._registered:
            return self._registered[name]
        if self.root is not None:
            folder = self._root_folder(name)
            if folder is not None:
                return folder
        raise AdapterNotFoundError(f"adapter {name!r} is not registered and not found in the adapter root")

    def _insert(self, adapter: HostAdapter) -> None:
        if adapter.nbytes > self.budget_bytes:
            raise AdapterError(
                f"adapter {adapter.name!r} needs {adapter.nbytes} bytes of host memory, more than the whole "
                f"host budget ({self.budget_bytes} bytes)"
            )
        # Room first, then the adapter: host_bytes never exceeds the budget, even as seen by a reader without the lock.
        while self._host and self.host_bytes + adapter.nbytes > self.budget_bytes:
            victim, _ = next(iter(self._host.items()))
            self._drop(victim)
            self.host_evictions += 1
            logger.debug("host budget: dropped adapter %r from host memory", victim)  # counted: host_evictions
        self._host[adapter.name] = adapter
        self._ranks[adapter.name] = _rank_map(adapter.target_modules, adapter.ranks)
        self._refs[adapter.name] = adapter.ref
        self.host_bytes += adapter.nbytes
        self.loads += 1

    def _drop(self, name: str) -> None:
        adapter = self._host.pop(name, None)
        if adapter is not None:
            self.host_bytes -= adapter.nbytes


def _rank_map(modules: tuple[str, ...], ranks: tuple[int, ...]) -> dict[str, int]:
    """module → rank of the modules an adapter targets (AdapterInfo.ranks)."""
    return dict(zip(modules, [r for r in ranks if r]))


def _done(adapter: HostAdapter) -> Future[HostAdapter]:
    future = Future[HostAdapter]()
    future.set_result(adapter)
    return future


def validate_name_quietly(name: object) -> bool:
    """Whether `name` passes validate_adapter_name, without raising."""
    try:
        validate_adapter_name(name)
    except AdapterError:
        return False
    return True
