"""Work that stops when the HTTP client goes away: a request the client no longer waits for is aborted in slora.

Two places need it. A whole (non-streamed) completion and the wait for a stream's first token run under
`until_disconnected`, which cancels them when the client disconnects: cancelling slora's stream aborts the request
and frees its KV pages. Once a stream has begun, Starlette watches the connection and cancels the body; the
response below then closes the body's generator at once, so the stream to Triton never outlives the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before the answer was ready; its work was cancelled."""


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientDisconnected (with `work` cancelled) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        for pending in (task, watcher):
            pending.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def _disconnect(request: Request) -> None:
    # The body has been read: the next message of the connection is its end.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its generator however the response ends (Starlette leaves a body that was
    cancelled mid-stream to the garbage collector)."""

    def __init__(self, content: AsyncGenerator[str, None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._generator = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._generator.aclose()
