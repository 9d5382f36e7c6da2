"""Text generation against the `slora` model (text in, text out): gRPC streaming or HTTP generate / generate_stream.

Both yield `Chunk`s as the server sends them: a text delta and, on the last one, the finish reason. Errors the
server sends for the request raise `ServerError` with its message.
"""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class ServerError(RuntimeError):
    """The server answered the request with an error."""


@dataclass(frozen=True)
class Chunk:
    text: str
    finish_reason: str = ""
    final: bool = False


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    model: str = "slora"  # or "ensemble", its alias
    adapter: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # sampling_parameters (max_tokens, temperature, ...)
    stream: bool = True
    parameters: dict[str, Any] = field(default_factory=dict)  # request parameters (e.g. apply_chat_template)

    def inputs(self) -> dict[str, Any]:
        values: dict[str, Any] = {"text_input": self.prompt, "stream": self.stream}
        if self.sampling:
            values["sampling_parameters"] = json.dumps(self.sampling)
        if self.adapter:
            values["adapter_id"] = self.adapter
        return values


def grpc_generate(url: str, request: GenerateRequest, timeout_s: float = 600.0) -> Iterator[Chunk]:
    """Stream over gRPC (bidirectional stream); closing the iterator early cancels the request."""
    import tritonclient.grpc as grpcclient

    responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    finished = False
    try:
        client.async_stream_infer(request.model, _grpc_inputs(grpcclient, request.inputs()),
                                  request_id=uuid.uuid4().hex, parameters=request.parameters or None,
                                  enable_empty_final_response=True)  # fmt: skip
        while not finished:
            result, error = responses.get(timeout=timeout_s)
            if error is not None:
                finished = True
                raise ServerError(error.message() if hasattr(error, "message") else str(error))
            chunk = _grpc_chunk(result)
            finished = chunk.final
            yield chunk
    finally:
        client.stop_stream(cancel_requests=not finished)
        client.close()


def http_generate(url: str, request: GenerateRequest, timeout_s: float = 600.0) -> Iterator[Chunk]:
    """HTTP generate_stream (server-sent events) when streaming, else one HTTP generate call."""
    body = {**request.inputs(), **({"parameters": request.parameters} if request.parameters else {})}
    endpoint = "generate_stream" if request.stream else "generate"
    http = urllib.request.Request(
        f"http://{url}/v2/models/{request.model}/{endpoint}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(http, timeout=timeout_s) as response:
            if not request.stream:
                yield _http_chunk(json.loads(response.read()), final=True)
                return
            for line in response:
                if line.startswith(b"data:"):
                    chunk = _http_chunk(json.loads(line[5:]), final=False)
                    yield chunk
    except urllib.error.HTTPError as exc:
        raise ServerError(_http_error(exc)) from None


def _grpc_inputs(grpcclient: Any, values: dict[str, Any]) -> list[Any]:
    inputs = []
    for name, value in values.items():
        array = (
            np.asarray([value], dtype=np.bool_)
            if isinstance(value, bool)
            else np.asarray([value.encode()], dtype=np.object_)
        )
        tensor = grpcclient.InferInput(name, list(array.shape), "BOOL" if array.dtype == np.bool_ else "BYTES")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _grpc_chunk(result: Any) -> Chunk:
    parameters = result.get_response().parameters
    final = "triton_final_response" in parameters and parameters["triton_final_response"].bool_param
    text = result.as_numpy("text_output")
    reason = result.as_numpy("finish_reason")
    return Chunk(
        text=_first_string(text),
        finish_reason=_first_string(reason),
        final=bool(final),
    )


def _http_chunk(payload: dict[str, Any], final: bool) -> Chunk:
    if "error" in payload:
        raise ServerError(str(payload["error"]))
    reason = payload.get("finish_reason", "")
    reason = reason[0] if isinstance(reason, list) and reason else reason
    text = payload.get("text_output", "")
    text = "".join(text) if isinstance(text, list) else text
    return Chunk(text=str(text), finish_reason=str(reason or ""), final=final or bool(reason))


def _first_string(array: np.ndarray | None) -> str:
    if array is None or array.size == 0:
        return ""
    value = array.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _http_error(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read()).get("error", exc.reason))
    except (ValueError, AttributeError):
        return f"HTTP {exc.code}: {exc.reason}"
