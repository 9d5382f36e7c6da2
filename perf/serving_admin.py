"""Adapter control requests to the `slora` model (its `adapter_command` input): load into host memory, list.

bench_serving uses them so that a served run starts in the state an in-process run starts in: the trace's
adapters in the server's host memory, none made resident on the GPU by the preloading itself. Each command is
one request with one response holding `adapter_result` (JSON); errors come back without a request id (see
bench_serving), so they are counted, not attributed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def command_request(client: Any, model: str, request_id: str, op: str, name: str | None) -> dict[str, Any]:
    tensors = {"adapter_command": np.asarray([op.encode()], dtype=np.object_)}
    if name is not None:
        tensors["adapter_id"] = np.asarray([name.encode()], dtype=np.object_)
    inputs = []
    for key, array in tensors.items():
        tensor = client.infer_input(key, list(array.shape), "BYTES")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return {"model_name": model, "inputs": inputs, "request_id": request_id}


async def run_commands(
    client: Any, model: str, commands: list[tuple[str, str | None]], timeout_s: float = 300.0
) -> tuple[list[Any], list[str]]:
    """Send (op, name) commands over one stream; returns the parsed results (None where missing) and errors."""
    results: list[Any] = [None] * len(commands)
    errors: list[str] = []
    queue: asyncio.Queue = asyncio.Queue()
    for i, (op, name) in enumerate(commands):
        queue.put_nowait(command_request(client, model, f"cmd-{i}", op, name))
    queue.put_nowait(None)

    async def requests() -> Any:
        while (item := await queue.get()) is not None:
            yield item

    async def receive() -> None:
        answered = 0
        async for result, error in client.stream_infer(requests()):
            answered += 1
            if error is not None:
                errors.append(str(error))
            else:
                index = int(result.get_response().id.removeprefix("cmd-"))
                raw = result.as_numpy("adapter_result")
                results[index] = json.loads(raw.reshape(-1)[0]) if raw is not None and raw.size else {}
            if answered == len(commands):
                return

    if commands:
        await asyncio.wait_for(receive(), timeout_s)
    return results, errors


async def load_into_host(client: Any, model: str, names: list[str]) -> bool:
    """Ask the server to read every adapter into host memory; False if any command failed."""
    _, errors = await run_commands(client, model, [("load", name) for name in names])
    if errors:
        logger.warning("%d of %d adapter loads failed, e.g. %s", len(errors), len(names), errors[0])
    return not errors


async def count_on_gpu(client: Any, model: str) -> int | None:
    """How many adapters the server holds in its GPU page pool now (None if it cannot say)."""
    try:
        results, errors = await run_commands(client, model, [("list", None)], timeout_s=60.0)
    except (asyncio.TimeoutError, OSError) as exc:
        logger.warning("adapter list failed: %s", exc)
        return None
    if errors or not results[0]:
        return None
    return sum(1 for row in results[0].get("adapters", []) if row.get("state") == "gpu")
