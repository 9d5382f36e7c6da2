"""Take what queued up as one batch: the shape of every hand-off loop between threads (pump, responder, engine).

Each of those threads sleeps on a queue, wakes for one item, then takes what else is already there, so that
work which piled up while it was busy is handled (and sent) at once. `None` on a queue asks its reader to stop.
"""

from __future__ import annotations

import queue
from typing import TypeVar

T = TypeVar("T")


def take_batch(
    inbox: queue.SimpleQueue[T | None] | queue.Queue[T | None], limit: int, timeout: float | None = None
) -> tuple[list[T], bool]:
    """Wait up to `timeout` (None: forever) for one item, then take what is queued, up to `limit` items.

    Returns the items (none if the wait timed out) and whether the stop marker `None` was taken; items queued
    after the marker are left on the queue.
    """
    items: list[T] = []
    try:
        item = inbox.get(timeout=timeout) if timeout != 0 else inbox.get_nowait()
    except queue.Empty:
        return items, False
    while item is not None:
        items.append(item)
        if len(items) >= limit:
            return items, False
        try:
            item = inbox.get_nowait()
        except queue.Empty:
            return items, False
    return items, True
