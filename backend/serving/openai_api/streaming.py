"""Server-sent events of a streamed completion: one chunk per slora response, then usage if asked, then [DONE].

    data: {chunk}\\n\\n ... data: {usage chunk}\\n\\n  data: [DONE]\\n\\n

Each chunk's text is the delta of one slora response (the engine's incremental detokenizer: decoded once, in the
engine), so the deltas concatenate to exactly the non-streamed text. An error after the stream began (the
headers are gone) is sent as an `error` event in OpenAI's format, which the openai client raises, then [DONE].
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from pydantic import BaseModel

from slora.backend.serving.openai_api.errors import OpenAIError
from slora.backend.serving.openai_api.responses import (
    ChatDelta,
    Head,
    Usage,
    chat_chunk,
    completion_chunk,
    usage_chunk,
)
from slora.backend.serving.openai_api.triton_client import SloraPiece, TritonCallError

DONE = "data: [DONE]\n\n"


@dataclass
class TokenCount:
    """Usage of one request, summed over its slora responses."""

    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, piece: SloraPiece) -> None:
        self.prompt_tokens = piece.num_input_tokens or self.prompt_tokens
        self.completion_tokens += piece.num_output_tokens

    def usage(self) -> Usage:
        return Usage.of(self.prompt_tokens, self.completion_tokens)


def event(body: BaseModel) -> str:
    return f"data: {body.model_dump_json(exclude_unset=True)}\n\n"


async def completion_events(
    pieces: AsyncGenerator[SloraPiece, None],
    head: Head,
    include_usage: bool,
    to_error: Callable[[TritonCallError], OpenAIError],
    echo: str = "",
) -> AsyncGenerator[str, None]:
    """The events of a streamed /v1/completions request; `echo` (the prompt) comes first."""
    async with aclosing(pieces):  # closing the events closes slora's stream: a running request is aborted
        if echo:
            yield event(completion_chunk(head, echo, None, include_usage))
        count = TokenCount()
        try:
            async for piece in pieces:
                count.add(piece)
                if piece.text or piece.finish_reason:
                    yield event(completion_chunk(head, piece.text, piece.finish_reason or None, include_usage))
        except TritonCallError as exc:
            yield _error_event(to_error(exc))
        else:
            if include_usage:
                yield event(usage_chunk(head, count.usage(), chat=False))
        yield DONE


async def chat_events(
    pieces: AsyncGenerator[SloraPiece, None],
    head: Head,
    include_usage: bool,
    to_error: Callable[[TritonCallError], OpenAIError],
) -> AsyncGenerator[str, None]:
    """The events of a streamed /v1/chat/completions request: the assistant's role first, then content deltas."""
    async with aclosing(pieces):
        yield event(chat_chunk(head, ChatDelta(role="assistant", content=""), None, include_usage))
        count = TokenCount()
        try:
            async for piece in pieces:
                count.add(piece)
                if piece.text or piece.finish_reason:
                    delta = ChatDelta(content=piece.text) if piece.text else ChatDelta()
                    yield event(chat_chunk(head, delta, piece.finish_reason or None, include_usage))
        except TritonCallError as exc:
            yield _error_event(to_error(exc))
        else:
            if include_usage:
                yield event(usage_chunk(head, count.usage(), chat=True))
        yield DONE


def _error_event(error: OpenAIError) -> str:
    return f"data: {json.dumps(error.body())}\n\n"
