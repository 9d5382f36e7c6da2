"""The request bodies of /v1/completions and /v1/chat/completions: validated once, errors naming the field.

As OpenAI's own API does, an unknown field is refused ("Unrecognized request argument supplied: x"), so that a
client never believes a knob took effect when this server has none. Fields the engine cannot honour (n > 1,
logprobs, penalties, logit_bias, tools, best_of, suffix, a JSON response format) are accepted only with their
neutral values and refused otherwise, each with a message that says so. Extra fields in the vLLM manner:
top_k, ignore_eos, stop_token_ids; and tenant, priority, ttft_slo_s for the engine's scheduler (docs/openai.md).
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from slora.backend.engine.sampling_params import MAX_SEED
from slora.backend.serving.openai_api.errors import OpenAIError, bad_request

Request = TypeVar("Request", bound=BaseModel)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    """What completions and chat completions share: the model, the sampling and the stream."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: Any = None  # a string or a list of strings (checked below: union errors would not name the field)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # logged with the request id
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    tenant: str | None = None  # the engine's fair-share group (engine/tenants.py)
    priority: int | None = None
    ttft_slo_s: float | None = Field(None, gt=0.0)
    metadata: dict[str, str] | None = None  # accepted and ignored: it does not change what is generated
    store: bool | None = None
    service_tier: str | None = None  # accepted and ignored: there is one tier

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> list[str] | None:
        if value is None:
            return None
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
            raise ValueError("must be a non-empty string or a list of non-empty strings")
        return items or None

    @field_validator("n")
    @classmethod
    def _n(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only n=1 is supported: send one request per choice")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, value: float | None) -> float | None:
        if value not in (None, 0, 0.0):
            raise ValueError("only 0 is supported: the engine applies no penalties")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("not supported: the engine applies no logit bias")
        return value

    @field_validator("store")
    @classmethod
    def _store(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("not supported: this server stores no completions")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(i < 0 for i in value):
            raise ValueError("must be token ids (>= 0)")
        return value

    @model_validator(mode="after")
    def _stream_options(self) -> _GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self


class CompletionRequest(_GenerationRequest):
    prompt: Any  # one string, or one prompt's token ids (a one-element list of either is accepted too)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[int]:
        return single_prompt(value)

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError("not supported: the engine computes no log probabilities")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("not supported (no fill-in-the-middle)")
        return value

    @model_validator(mode="after")
    def _echo(self) -> CompletionRequest:
        if self.echo and not isinstance(self.prompt, str):
            raise ValueError("echo needs a text prompt (the prompt was given as token ids)")
        return self


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str = ""  # sent as a string, a list of text parts {"type": "text", "text": ...}, or null
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> str:
        return message_text(value)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # accepted and ignored: no tools run
    response_format: dict[str, Any] | None = None

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("not supported: the engine computes no log probabilities")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError("not supported: the engine computes no log probabilities")
        return value

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError("not supported: this server parses no tool calls")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value not in (None, "none"):
            raise ValueError("not supported: this server parses no tool calls")
        return value

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value != {"type": "text"}:
            raise ValueError('only {"type": "text"} is supported (no guided decoding)')
        return value

    @model_validator(mode="after")
    def _max_tokens(self) -> ChatCompletionRequest:
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens differ: give one of them")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def single_prompt(value: Any) -> str | list[int]:
    """One prompt: a string or a list of token ids; a batch of one is unwrapped, larger batches are refused."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise ValueError("must not be empty")
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if any(t < 0 for t in value):
            raise ValueError("token ids must be >= 0")
        return value
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise ValueError("only one prompt per request is supported: send one request per prompt")
    raise ValueError("must be a non-empty string or a list of token ids")


def message_text(value: Any) -> str:
    """A message's content as one string: text parts joined by newlines (as vLLM joins them)."""
    if value is None or isinstance(value, str):
        return value or ""
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of content parts")
    texts = []
    for i, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"part {i} is not a text part ({kind!r}): this server takes text only")
        texts.append(part["text"])
    return "\n".join(texts)


def parse_body(body: bytes, model: type[Request]) -> Request:
    """The validated request of a JSON body; raises OpenAIError (400) naming the field at fault."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(payload, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise _field_error(exc) from None


def _field_error(exc: ValidationError) -> OpenAIError:
    error = exc.errors(include_url=False)[0]
    param = _param(error["loc"])
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param)
    if error["type"] == "missing":
        return bad_request(f"missing required parameter {param!r}", param)
    if not param:  # a check across fields: its message names them
        return bad_request(message)
    return bad_request(f"{param}: {message} (got {_short(error.get('input'))})", param)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _param(loc: tuple[int | str, ...]) -> str:
    """('messages', 0, 'content') → 'messages[0].content'."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text
