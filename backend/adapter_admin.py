"""Adapter control requests (list / load / unload) against a running engine, answered as JSON-ready dicts.

Each adapter is reported with its highest tier: `gpu` when resident in the engine's page pool (device memory),
`host` when its weights are in host memory, `disk` when it is only known (registered, or a folder under the
adapter root). Ranks are known once an adapter has been read.

Loading reads the adapter in the calling thread (the store is thread-safe) so a slow disk never stalls the batch;
what touches the pool runs on the engine thread through `EngineLoop.call`.
"""

from __future__ import annotations

from typing import Any

from slora.backend.engine import LLMEngine
from slora.backend.engine_loop import EngineLoop
from slora.backend.errors import AdapterNotFoundError
from slora.backend.request_inputs import AdapterCommand


def run_adapter_command(loop: EngineLoop, command: AdapterCommand) -> dict[str, Any]:
    """Carry out `command`; raises AdapterError/AdapterNotFoundError with a message naming the adapter."""
    if command.op == "list":
        return {"adapters": loop.call(adapter_table)}
    assert command.name is not None  # parse_adapter_command checks it
    if command.op == "load":
        _load(loop.engine, command.name, command.path)
    else:
        _unload(loop, command.name)
    return {"adapters": [row for row in loop.call(adapter_table) if row["name"] == command.name]}


def adapter_table(engine: LLMEngine) -> list[dict[str, Any]]:
    """Every known adapter with its tier and ranks (call on the engine thread)."""
    resident = {r.host.name for r in engine.cache.resident()}
    rows = []
    for info in engine.list_adapters():
        tier = "gpu" if info.name in resident else "host" if info.in_host else "disk"
        rows.append(
            {
                "name": info.name,
                "path": info.path,
                "state": tier,
                "rank": max(info.ranks.values()) if info.ranks else None,
                "ranks": info.ranks,
            }
        )
    return rows


def _load(engine: LLMEngine, name: str, path: str | None) -> None:
    if path:
        engine.store.register(name, path, load=True)
    else:
        engine.store.get(name)  # from the registry or the adapter root, into host memory


def _unload(loop: EngineLoop, name: str) -> None:
    store = loop.engine.store
    try:
        store.unregister(name)
    except AdapterNotFoundError:
        if any(a.name == name for a in store.list()):
            raise AdapterNotFoundError(
                f"adapter {name!r} is not registered: it is a folder under the adapter root ({store.root}); "
                "remove the folder to retire it"
            ) from None
        raise

    def drop(engine: LLMEngine) -> None:
        live = {r.key for r in engine.cache.resident() if r.host.name != name}
        engine.cache.drop_stale(live)  # requests still running with it keep it pinned until they finish

    loop.call(drop)
