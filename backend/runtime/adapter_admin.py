"""Adapter control requests (list / load / unload) against a running engine, answered as JSON-ready dicts.

Each adapter is reported with its highest tier: `gpu` when resident in the engine's page pool (device memory),
`host` when its weights are in host memory, `disk` when it is only known (registered, or a folder under the
adapter root). Ranks are known once an adapter has been read. Entries of the adapter root that cannot be served
(a symlink out of the root, a name no client can send) are not adapters: `list` reports them apart, under
`skipped`, with the reason.

Loading reads the adapter in the calling thread (the store is thread-safe) so a slow disk never stalls the batch;
what touches the pool runs on the engine thread through `EngineLoop.call`.

Every load and unload is logged (INFO, logger `slora.backend.runtime.adapter_admin`) with what changed: the name
and its old and new path, or why it was refused. `RuntimeRegistry` remembers the registrations that succeeded, so
that an engine started again (engine_process.py) can be given them back.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from slora.backend.adapters.host_adapter import HostAdapter
from slora.backend.adapters.store import AdapterStore, validate_adapter_name
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.errors import AdapterNotFoundError
from slora.backend.model.spec import LORA_MODULES
from slora.backend.runtime.engine_loop import EngineLoop
from slora.backend.runtime.messages import AdapterCommand

logger = logging.getLogger(__name__)


def run_adapter_command(loop: EngineLoop, command: AdapterCommand) -> dict[str, Any]:
    """Carry out `command`; raises AdapterError (AdapterExistsError, AdapterNotFoundError) naming the adapter.

    `list` reports every adapter (and lists the adapter root) and the root's skipped entries; `load` reports the
    loaded one only, so that loading thousands of adapters one by one stays linear; `unload` reports nothing.
    """
    if command.op == "list":
        adapters = loop.call(adapter_table)
        logger.debug("adapter admin: list (%d adapters)", len(adapters))
        return {"adapters": adapters, "skipped": skipped_entries(loop.engine.store)}
    name = validate_adapter_name(command.name)
    try:
        if command.op == "unload":
            _unload(loop, name)
            return {"adapters": []}
        adapter = _load(loop, name, command.path, command.replace)
    except Exception as exc:
        logger.info("adapter admin: %s %r refused: %s", command.op, name, exc)
        raise
    resident = loop.call(lambda engine: any(r.host.name == name for r in engine.cache.resident()))
    return {"adapters": [_row(name, str(adapter.path), "gpu" if resident else "host", adapter_ranks(adapter))]}


def adapter_ranks(adapter: HostAdapter) -> dict[str, int]:
    return {module: rank for module, rank in zip(LORA_MODULES, adapter.ranks) if rank}


def adapter_table(engine: LLMEngine) -> list[dict[str, Any]]:
    """Every known adapter with its tier and ranks (call on the engine thread)."""
    resident = {r.host.name for r in engine.cache.resident()}
    rows = []
    for info in engine.list_adapters():
        tier = "gpu" if info.name in resident else "host" if info.in_host else "disk"
        rows.append(_row(info.name, info.path, tier, info.ranks))
    return rows


def skipped_entries(store: AdapterStore) -> list[dict[str, str]]:
    """The adapter root's entries that the last listing skipped, with why, sorted by name."""
    return [{"name": name, "error": reason} for name, reason in sorted(store.bad_entries().items())]


def _row(name: str, path: str, state: str, ranks: dict[str, int] | None) -> dict[str, Any]:
    return {"name": name, "path": path, "state": state, "rank": max(ranks.values()) if ranks else None, "ranks": ranks}


def _load(loop: EngineLoop, name: str, path: str | None, replace: bool) -> HostAdapter:
    store = loop.engine.store
    if not path:
        adapter = store.get(name)  # from the registry or the adapter root, into host memory: nothing re-pointed
        logger.info("adapter admin: load %r: read into host memory from %s", name, adapter.path)
        return adapter
    old = store.path_of(name)
    registered = store.register(name, path, load=True, replace=replace)
    assert registered is not None  # load=True returns the adapter
    if old is not None:
        _drop_unpinned(loop, name)  # the old weights' pages: no request after this one uses them
    logger.info("adapter admin: load %r: %s → %s", name, old if old is not None else "(new)", registered.path)
    return registered


def _unload(loop: EngineLoop, name: str) -> None:
    store = loop.engine.store
    try:
        old = store.unregister(name)
    except AdapterNotFoundError:
        if store.in_root(name):
            raise AdapterNotFoundError(
                f"adapter {name!r} is not registered: it is a folder under the adapter root ({store.root}); "
                "remove the folder to retire it"
            ) from None
        raise
    _drop_unpinned(loop, name)
    logger.info("adapter admin: unload %r: %s → (gone)", name, old)


def _drop_unpinned(loop: EngineLoop, name: str) -> None:
    """Evict `name`'s adapters from the pool, but those that running requests pin (they keep them until done)."""

    def drop(engine: LLMEngine) -> None:
        live = {r.key for r in engine.cache.resident() if r.host.name != name}
        engine.cache.drop_stale(live)

    loop.call(drop)


class RuntimeRegistry:
    """The registrations made at runtime that succeeded, in order: name → the `load` with a path or the `unload`
    that came last for it. Given back to a new engine process (`replay`), they make it serve the same adapters
    as the one that died: loads with replace=True (the name may be a folder of the root, or be registered by the
    multi_lora.json again), unloads of names the multi_lora.json registers again at start-up. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._commands: dict[str, AdapterCommand] = {}

    def record(self, command: AdapterCommand) -> None:
        """Remember `command` if it changed a registration (call once it succeeded, in the order they did)."""
        if command.name is None or not (command.op == "unload" or (command.op == "load" and command.path)):
            return  # list, or load of a known adapter into host memory: nothing to give back
        with self._lock:
            self._commands.pop(command.name, None)  # re-inserted last: replayed in the order they happened
            self._commands[command.name] = AdapterCommand(command.op, command.name, command.path, replace=True)

    def forget(self, name: str) -> None:
        with self._lock:
            self._commands.pop(name, None)

    def replay(self) -> list[AdapterCommand]:
        """The commands that give a new engine the same registrations, in order."""
        with self._lock:
            return list(self._commands.values())

    def registered(self) -> dict[str, str]:
        """name → path of the adapters registered at runtime and still registered."""
        with self._lock:
            return {c.name: c.path for c in self._commands.values() if c.op == "load" and c.name and c.path}
