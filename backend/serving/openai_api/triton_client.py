"""The async gRPC client of the local Triton: one bidirectional stream per request, to the `slora` model.

Each request opens its own ModelStreamInfer call on one shared channel, sends one inference request and reads
responses until its last one (a non-empty `finish_reason`) or an error. The request side stays open until then, as
tritonclient's own streams do. Leaving the iterator early (the HTTP client went away, the server stops) cancels the
call: Triton marks the request cancelled and slora aborts it in the engine, which frees its KV pages within slora's
cancellation check (0.2 s). Only the outputs read are asked for, so slora builds no others.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

logger = logging.getLogger(__name__)

OUTPUTS = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens")
T = TypeVar("T")
CLOSE_TIMEOUT_S = 2.0  # how long Triton may take to close a stream whose request has finished


@dataclass(frozen=True)
class SloraRequest:
    """One generation as slora takes it: the prompt (text, tokenized once in slora, or token ids), the adapter,
    the sampling fields (its `sampling_parameters` JSON) and the request parameters."""

    request_id: str
    prompt: str | list[int]
    adapter: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    parameters: dict[str, str | int | float | bool] = field(default_factory=dict)


@dataclass(frozen=True)
class SloraPiece:
    """One slora response: the new text (a delta when streaming, the whole text otherwise) and its token counts."""

    text: str
    num_input_tokens: int
    num_output_tokens: int  # tokens in this response
    finish_reason: str  # "" until the last response


class TritonCallError(Exception):
    """slora or Triton answered with an error (its message only: Triton 2.51 sends no status code on streams), or
    Triton could not be reached (`reachable` False)."""

    def __init__(self, message: str, reachable: bool = True) -> None:
        super().__init__(message)
        self.reachable = reachable


class SloraClient:
    """Generation and the adapter list through the `slora` model; create it inside the server's event loop."""

    def __init__(self, url: str, model: str = "slora", admin_token: str | None = None) -> None:
        self._client = grpcclient.InferenceServerClient(url)
        self._model = model
        self._admin_token = admin_token

    async def generate(self, request: SloraRequest) -> AsyncGenerator[SloraPiece, None]:
        """slora's responses to `request`, the last one with its finish_reason; raises TritonCallError."""
        call = {
            "model_name": self._model,
            "inputs": _generation_inputs(request),
            "outputs": [grpcclient.InferRequestedOutput(name) for name in OUTPUTS],
            "request_id": request.request_id,
            "parameters": _parameters(request),
        }
        async with aclosing(self._responses(call, _piece, lambda piece: bool(piece.finish_reason))) as pieces:
            async for piece in pieces:
                yield piece

    async def adapters(self) -> dict[str, Any]:
        """The answer of slora's `list` command: {"adapters": [{"name", "state", "rank", ...}], "skipped": [...]}."""
        call = {
            "model_name": self._model,
            "inputs": [_bytes_input("adapter_command", "list")],
            "outputs": [grpcclient.InferRequestedOutput("adapter_result")],
            "parameters": {"admin_token": self._admin_token} if self._admin_token else None,
        }
        async with aclosing(self._responses(call, lambda result: _string(result, "adapter_result"), bool)) as answers:
            async for answer in answers:
                return dict(json.loads(answer))
        raise TritonCallError("slora sent no adapter_result")

    async def ready(self) -> bool:
        try:
            return bool(await self._client.is_model_ready(self._model))
        except InferenceServerException:
            return False

    async def close(self) -> None:
        await self._client.close()

    async def _responses(
        self, call: dict[str, Any], read: Callable[[Any], T], is_last: Callable[[T], bool]
    ) -> AsyncGenerator[T, None]:
        """`read` of each response to one request, on a stream of its own, up to the one `is_last` accepts. A caller
        that stops reading before that cancels the stream, and slora aborts the request."""
        finished = asyncio.Event()

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield call
            await finished.wait()  # closing the request side at once would end the stream before the responses

        stream = self._client.stream_infer(requests())
        complete = False
        try:
            async for result, error in stream:
                if error is not None:
                    complete = True  # an error response is the request's last
                    raise TritonCallError(error.message())
                value = read(result)
                complete = is_last(value)
                yield value
                if complete:
                    break
            if not complete:
                raise TritonCallError("the stream ended before the request finished")
        except grpc.aio.AioRpcError as exc:
            complete = True
            reachable = exc.code() != grpc.StatusCode.UNAVAILABLE
            raise TritonCallError(f"Triton: {exc.details()}", reachable=reachable) from None
        finally:
            finished.set()
            await _close(stream, cancel=not complete)


async def _close(stream: Any, cancel: bool) -> None:
    """End a stream: cancel it, or let Triton close it after the request side (a call dropped while still open
    would be cancelled when it is garbage-collected, and slora would log a cancellation)."""
    if not cancel:
        try:
            await asyncio.wait_for(_drain(stream), CLOSE_TIMEOUT_S)
            return
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, TritonCallError):
            pass
    stream.cancel()


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


def _generation_inputs(request: SloraRequest) -> list[grpcclient.InferInput]:
    if isinstance(request.prompt, str):
        prompt = _bytes_input("text_input", request.prompt)
    else:
        prompt = _array_input("input_ids", np.asarray(request.prompt, dtype=np.int32), "INT32")
    return [
        prompt,
        _array_input("stream", np.asarray([request.stream]), "BOOL"),
        # The prompt's echo is ours to add (completions' `echo`), never slora's.
        _array_input("exclude_input_in_output", np.asarray([True]), "BOOL"),
        _bytes_input("sampling_parameters", json.dumps(request.sampling)),
    ]


def _parameters(request: SloraRequest) -> dict[str, str | int | float | bool]:
    parameters = dict(request.parameters)
    if request.adapter:
        parameters["adapter_id"] = request.adapter
    return parameters


def _bytes_input(name: str, text: str) -> grpcclient.InferInput:
    return _array_input(name, np.asarray([text.encode()], dtype=np.object_), "BYTES")


def _array_input(name: str, array: np.ndarray, dtype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def _piece(result: Any) -> SloraPiece:
    """One response's outputs, read straight from its raw contents: tritonclient's as_numpy costs about 7 µs an
    output, which a stream pays for every token (BYTES: a 4-byte length, then the bytes; UINT32: 4 bytes)."""
    response = result.get_response()
    raw = dict(zip((output.name for output in response.outputs), response.raw_output_contents))
    if len(raw) != len(response.outputs):  # not sent as raw contents: the general path
        return SloraPiece(_string(result, "text_output"), _count(result, "num_input_tokens"),
                          _count(result, "num_output_tokens"), _string(result, "finish_reason"))  # fmt: skip
    return SloraPiece(
        text=_raw_string(raw.get("text_output")),
        num_input_tokens=_raw_count(raw.get("num_input_tokens")),
        num_output_tokens=_raw_count(raw.get("num_output_tokens")),
        finish_reason=_raw_string(raw.get("finish_reason")),
    )


def _raw_string(content: bytes | None) -> str:
    if not content or len(content) < 4:
        return ""
    length = int.from_bytes(content[:4], "little")
    return content[4 : 4 + length].decode("utf-8")


def _raw_count(content: bytes | None) -> int:
    return int.from_bytes(content[:4], "little") if content and len(content) >= 4 else 0


def _string(result: Any, name: str) -> str:
    array = result.as_numpy(name)
    if array is None or not array.size:
        return ""
    value = array.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _count(result: Any, name: str) -> int:
    array = result.as_numpy(name)
    return int(array.reshape(-1)[0]) if array is not None and array.size else 0
