"""Admin requests (adapters: list / load / unload; tenants' weights) against a running engine, answered as
JSON-ready dicts.

Each adapter is reported with its highest tier: `gpu` when resident in the engine's page pool (device memory),
`host` when its weights are in host memory, `disk` when it is only known (registered, or a folder under the
adapter root). Ranks are known once an adapter has been read. Entries of the adapter root that cannot be served
(a symlink out of the root, a name no client can send) are not adapters: `list` reports them apart, under
`skipped`, with the reason.

Loading reads the adapter in the calling thread (the store is thread-safe) so a slow disk never stalls the batch;
what touches the pool runs on the engine thread through `EngineLoop.call`.

Every load and unload is logged (INFO, logger `slora.backend.runtime.adapter_admin`) with what changed: the name
and its old and new path, or why it was refused. `RuntimeRegistry` remembers the registrations that succeeded, so
that an engine started again (engine_process.py) can be given them back, and can write them back to the
multi_lora.json the server started from, so that a server started again has them too.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
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
    if command.op == "tenant_weights":
        return {"tenant_weights": _set_tenant_weights(loop, command)}
    try:
        name = validate_adapter_name(command.name)
        if command.op == "unload":
            _unload(loop, name)
            return {"adapters": []}
        adapter = _load(loop, name, command)
    except Exception as exc:
        logger.info("adapter admin: %s %r refused: %s", command.op, command.name, exc)
        raise
    if adapter is None:  # registered, not read (read=False)
        return {"adapters": [_row(name, str(command.path), "disk", None)]}
    resident = loop.call(lambda engine: any(r.host.name == name for r in engine.cache.resident()))
    return {"adapters": [_row(name, str(adapter.path), "gpu" if resident else "host", adapter_ranks(adapter))]}


def _set_tenant_weights(loop: EngineLoop, command: AdapterCommand) -> dict[str, float]:
    """Merge (or with `replace`, set) the tenants' weights; returns every weight now set."""
    weights = command.tenant_weights or {}
    try:
        now = loop.call(lambda engine: engine.set_tenant_weights(weights, command.replace))
    except Exception as exc:
        logger.info("admin: tenant weights %s refused: %s", weights, exc)
        raise
    logger.info("admin: tenant weights %s %s; now %s", "set to" if command.replace else "merged", weights, now)
    return now


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


def _load(loop: EngineLoop, name: str, command: AdapterCommand) -> HostAdapter | None:
    """Register `name` at the command's path (or read a known adapter into host memory, without a path)."""
    store = loop.engine.store
    if not command.path:
        adapter = store.get(name)  # from the registry or the adapter root, into host memory: nothing re-pointed
        logger.info("adapter admin: load %r: read into host memory from %s", name, adapter.path)
        return adapter
    old = store.path_of(name)
    registered = store.register(name, command.path, load=command.read, replace=command.replace)
    if old is not None:
        _drop_unpinned(loop, name)  # the old weights' pages: no request after this one uses them
    logger.info("adapter admin: load %r: %s → %s", name, old if old is not None else "(new)", command.path)
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
    """The registrations made at runtime that succeeded: name → the `load` with a path or the `unload` that came
    last for it. Given back to a new engine process (`replay`), they make it serve the same adapters
    as the one that died: loads with replace=True (the name may be a folder of the root, or be registered by the
    multi_lora.json again) and read=False (read when a request needs them, as at start-up), unloads of names the
    multi_lora.json registers again at start-up.

    With `file` (the server's multi_lora.json), each recorded change is also written to it at once (name → absolute
    path added or replaced, or removed), so that a server started again from it has them; a file that cannot be
    read as a JSON object is left alone (logged). With `journal` (a file of the server's workspace), the
    registrations are kept there too and read back by the next RuntimeRegistry of that journal: what a model that
    the server loads again (launcher/supervisor.py) starts from. Thread-safe.
    """

    def __init__(self, file: str | Path | None = None, journal: str | Path | None = None) -> None:
        self._lock = threading.Lock()
        self.file = Path(file) if file is not None else None
        self.journal = Path(journal) if journal is not None else None
        self._commands: dict[str, AdapterCommand] = _read_journal(self.journal) if self.journal else {}

    def record(self, command: AdapterCommand) -> None:
        """Remember `command` if it changed a registration (call once it succeeded, in the order they did)."""
        if command.name is None or not (command.op == "unload" or (command.op == "load" and command.path)):
            return  # list, or load of a known adapter into host memory: nothing to give back
        path = os.path.abspath(command.path) if command.path else None  # the engine's working directory is ours
        replay = AdapterCommand(command.op, command.name, path, replace=True, read=False)
        with self._lock:
            if self._commands.get(command.name) == replay:
                return  # given back by a restart, or loaded again from the same place: nothing new to write
            self._commands[command.name] = replay  # the last change of each name is all that counts
            if self.file is not None:
                _write_back(self.file, replay)
            self._save_journal()

    def forget(self, name: str) -> None:
        with self._lock:
            self._commands.pop(name, None)
            self._save_journal()

    def _save_journal(self) -> None:
        if self.journal is None:
            return
        rows = [{"op": c.op, "name": c.name, "path": c.path} for c in self._commands.values()]
        try:
            _replace_file(self.journal, json.dumps(rows, indent=2) + "\n")
        except OSError as exc:
            logger.error("runtime adapter registrations not kept in %s: %s", self.journal, exc)

    def replay(self) -> list[AdapterCommand]:
        """The commands that give a new engine the same registrations (one per name: any order will do)."""
        with self._lock:
            return list(self._commands.values())


def _read_journal(journal: Path) -> dict[str, AdapterCommand]:
    """The registrations a journal holds (none when it is missing; an unreadable one is logged and ignored)."""
    if not journal.exists():
        return {}
    try:
        rows = json.loads(journal.read_text())
        commands = [AdapterCommand(r["op"], r["name"], r["path"], replace=True, read=False) for r in rows]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.error("runtime adapter registrations in %s cannot be read (%s); starting without them", journal, exc)
        return {}
    return {c.name: c for c in commands if c.name is not None}


def _replace_file(file: Path, text: str) -> None:
    """Write `text` to `file` atomically: readers see the old file or the new one, never half of one."""
    staged = file.with_name(f".{file.name}.tmp")
    staged.write_text(text)
    os.replace(staged, file)


def _write_back(file: Path, command: AdapterCommand) -> None:
    """Apply one registration change to the multi_lora.json `file`, replacing it atomically."""
    assert command.name is not None
    try:
        entries = json.loads(file.read_text()) if file.exists() else {}
    except (OSError, ValueError) as exc:
        logger.error("adapter registry %s not updated (%s %r): cannot be read (%s)", file, command.op, command.name,
                     exc)  # fmt: skip
        return
    if not isinstance(entries, dict):
        logger.error("adapter registry %s not updated (%s %r): not a JSON object", file, command.op, command.name)
        return
    if command.op == "load":
        entries[command.name] = command.path
    else:
        entries.pop(command.name, None)
    try:
        _replace_file(file, json.dumps(entries, indent=2) + "\n")
    except OSError as exc:
        logger.error("adapter registry %s not updated (%s %r): %s", file, command.op, command.name, exc)
        return
    logger.info("adapter registry %s: %s %r written back", file, command.op, command.name)
