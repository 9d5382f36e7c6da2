"""POST /v1/completions and /v1/chat/completions: validate, name the adapter, run through slora, answer.

    body ─► protocol (400 naming the field) ─► ModelNames: the adapter ─► (chat: template → prompt text)
         ─► sampling: the slora request ─► SloraClient.generate ─► whole body, or SSE chunks (streaming.py)

A streamed request answers with its HTTP status only once slora's first response came, so that what slora refuses
at once (unknown adapter: 404, full queue: 429, bad input: 400) is an HTTP error, not a 200 stream with an error
in it. Every request has one id (cmpl-/chatcmpl-…), which is also its Triton request id, so logs correlate.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from slora.backend.serving.openai_api.chat import ChatRenderer
from slora.backend.serving.openai_api.config import OpenAIConfig
from slora.backend.serving.openai_api.disconnect import ClosingStreamingResponse, until_disconnected
from slora.backend.serving.openai_api.errors import OpenAIError, from_triton
from slora.backend.serving.openai_api.models import ModelNames, ModelRegistry
from slora.backend.serving.openai_api.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from slora.backend.serving.openai_api.responses import Head, chat_completion, completion
from slora.backend.serving.openai_api.sampling import chat_request, completion_request
from slora.backend.serving.openai_api.streaming import TokenCount, chat_events, completion_events
from slora.backend.serving.openai_api.triton_client import SloraClient, SloraPiece, SloraRequest, TritonCallError

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of the events


@dataclass(frozen=True)
class Service:
    """What the endpoints share, built once at start-up (app.py)."""

    config: OpenAIConfig
    client: SloraClient
    names: ModelNames
    registry: ModelRegistry
    chat: ChatRenderer


@dataclass(frozen=True)
class Whole:
    text: str
    finish_reason: str
    count: TokenCount


async def create_completion(service: Service, request: Request) -> Response:
    body = parse_body(await request.body(), CompletionRequest)
    head = Head.new("cmpl", body.model)
    _log(head, body.user, body.tenant)
    slora = completion_request(body, head.id, service.names.adapter_of(body.model))
    echo = body.prompt if body.echo and isinstance(body.prompt, str) else ""
    to_error = _error_mapper(service, body.model)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        pieces = await _started(service, request, slora, to_error)
        return _sse(completion_events(pieces, head, include_usage, to_error, echo))
    whole = await _whole(service, request, slora, to_error)
    return JSONResponse(completion(head, echo + whole.text, whole.finish_reason, whole.count.usage()).model_dump())


async def create_chat_completion(service: Service, request: Request) -> Response:
    body = parse_body(await request.body(), ChatCompletionRequest)
    head = Head.new("chatcmpl", body.model)
    _log(head, body.user, body.tenant)
    prompt = service.chat.render(body.messages)
    slora = chat_request(body, head.id, service.names.adapter_of(body.model), prompt)
    to_error = _error_mapper(service, body.model)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        pieces = await _started(service, request, slora, to_error)
        return _sse(chat_events(pieces, head, include_usage, to_error))
    whole = await _whole(service, request, slora, to_error)
    return JSONResponse(chat_completion(head, whole.text, whole.finish_reason, whole.count.usage()).model_dump())


async def _whole(
    service: Service, request: Request, slora: SloraRequest, to_error: Callable[[TritonCallError], OpenAIError]
) -> Whole:
    """slora's one response (or, merged, all of them), unless the client leaves first."""
    try:
        pieces = await until_disconnected(request, _collect(service.client.generate(slora)))
    except TritonCallError as exc:
        raise to_error(exc) from None
    count = TokenCount()
    for piece in pieces:
        count.add(piece)
    return Whole("".join(p.text for p in pieces), pieces[-1].finish_reason, count)


async def _collect(pieces: AsyncIterator[SloraPiece]) -> list[SloraPiece]:
    return [piece async for piece in pieces]


async def _started(
    service: Service, request: Request, slora: SloraRequest, to_error: Callable[[TritonCallError], OpenAIError]
) -> AsyncGenerator[SloraPiece, None]:
    """The stream of `slora`, once its first response came (errors before it are raised as OpenAIError)."""
    pieces = service.client.generate(slora)
    try:
        first = await until_disconnected(request, anext(pieces))
    except TritonCallError as exc:
        raise to_error(exc) from None
    return _prepend(first, pieces)


async def _prepend(first: SloraPiece, rest: AsyncGenerator[SloraPiece, None]) -> AsyncGenerator[SloraPiece, None]:
    async with aclosing(rest):  # closing this closes slora's stream, which cancels a request still running
        yield first
        async for piece in rest:
            yield piece


def _sse(events: AsyncGenerator[str, None]) -> Response:
    return ClosingStreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


def _error_mapper(service: Service, model: str) -> Callable[[TritonCallError], OpenAIError]:
    retry_after_s = service.config.retry_after_s
    return lambda exc: from_triton(str(exc), model, retry_after_s, exc.reachable)


def _log(head: Head, user: str | None, tenant: str | None) -> None:
    if user or tenant:
        logger.info("%s: model %r, user %r, tenant %r", head.id, head.model, user, tenant)
