"""Adapter control requests (list / load / unload) against a running engine, answered as JSON-ready dicts.

Each adapter is reported with its highest tier: `gpu` when resident in the engine's page pool (device memory),
`host` when its weights are in host memory, `disk` when it is only known (registered, or a folder under the
adapter root). Ranks are known once an adapter has been read.

Loading reads the adapter in the calling thread (the store is thread-safe) so a slow disk never stalls the batch;
what touches the pool runs on the engine thread through `EngineLoop.call`.
"""

from __future__ import annotations

from typing import Any

from slora.backend.adapters.host_adapter import HostAdapter
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.errors import AdapterNotFoundError
from slora.backend.model.spec import LORA_MODULES
from slora.backend.runtime.engine_loop import EngineLoop
from slora.backend.runtime.messages import AdapterCommand


def run_adapter_command(loop: EngineLoop, command: AdapterCommand) -> dict[str, Any]:
    """Carry out `command`; raises AdapterError/AdapterNotFoundError with a message naming the adapter.

    `list` reports every adapter (and lists the adapter root); `load` reports the loaded one only, so that
    loading thousands of adapters one by one stays linear; `unload` reports nothing.
    """
    if command.op == "list":
        return {"adapters": loop.call(adapter_table)}
    assert command.name is not None  # parse_adapter_command checks it
    name = command.name
    if command.op == "unload":
        _unload(loop, name)
        return {"adapters": []}
    adapter = _load(loop.engine, name, command.path)
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


def _row(name: str, path: str, state: str, ranks: dict[str, int] | None) -> dict[str, Any]:
    return {"name": name, "path": path, "state": state, "rank": max(ranks.values()) if ranks else None, "ranks": ranks}


def _load(engine: LLMEngine, name: str, path: str | None) -> HostAdapter:
    if path:
        adapter = engine.store.register(name, path, load=True)
        assert adapter is not None  # load=True returns the adapter
        return adapter
    return engine.store.get(name)  # from the registry or the adapter root, into host memory


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
