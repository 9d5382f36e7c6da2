"""The response bodies: completions, chat completions and their stream chunks, in OpenAI's shapes.

Whole bodies are serialized in full. Chunks are serialized with exclude_unset (streaming.py), so that a chat delta
carries only its role or its content; their builders below set every other field, null ones included, as OpenAI
sends them (`usage: null` on each chunk but the last only with stream_options.include_usage).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel


@dataclass(frozen=True)
class Head:
    """What every body and chunk of one request repeats: its id, creation time and the model name it asked for."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def new(cls, prefix: str, model: str) -> Head:
        return cls(f"{prefix}-{uuid.uuid4().hex}", model)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)  # fmt: skip


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class Completion(BaseModel):
    """A whole completion, and each chunk of a streamed one (same object type, as OpenAI streams them)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: None = None


def completion(head: Head, text: str, finish_reason: str, usage: Usage) -> Completion:
    choice = CompletionChoice(text=text, logprobs=None, finish_reason=finish_reason)
    return Completion(id=head.id, created=head.created, model=head.model, choices=[choice], usage=usage)


def completion_chunk(head: Head, text: str, finish_reason: str | None, with_usage: bool) -> Completion:
    choice = CompletionChoice(index=0, text=text, logprobs=None, finish_reason=finish_reason)
    chunk = Completion(id=head.id, object="text_completion", created=head.created, model=head.model,
                       choices=[choice], system_fingerprint=None)  # fmt: skip
    if with_usage:
        chunk.usage = None  # marks the field set: serialized as null
    return chunk


def chat_completion(head: Head, text: str, finish_reason: str, usage: Usage) -> ChatCompletion:
    choice = ChatChoice(message=ChatMessageOut(content=text), logprobs=None, finish_reason=finish_reason)
    return ChatCompletion(id=head.id, created=head.created, model=head.model, choices=[choice], usage=usage)


def chat_chunk(head: Head, delta: ChatDelta, finish_reason: str | None, with_usage: bool) -> ChatCompletionChunk:
    choice = ChatChunkChoice(index=0, delta=delta, logprobs=None, finish_reason=finish_reason)
    chunk = ChatCompletionChunk(id=head.id, object="chat.completion.chunk", created=head.created, model=head.model,
                                choices=[choice], system_fingerprint=None)  # fmt: skip
    if with_usage:
        chunk.usage = None  # marks the field set: serialized as null
    return chunk


def usage_chunk(head: Head, usage: Usage, chat: bool) -> Completion | ChatCompletionChunk:
    """The last chunk of a stream with stream_options.include_usage: no choices, the request's usage."""
    if chat:
        return ChatCompletionChunk(id=head.id, object="chat.completion.chunk", created=head.created,
                                   model=head.model, choices=[], usage=usage, system_fingerprint=None)  # fmt: skip
    return Completion(id=head.id, object="text_completion", created=head.created, model=head.model, choices=[],
                      usage=usage, system_fingerprint=None)  # fmt: skip
