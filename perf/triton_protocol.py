"""How a trace request becomes a Triton streaming request, and how streamed responses become token counts.

Two targets, both decoupled (streaming) models of model_repository/:

    tokens  the `slora` model:  input_ids INT32 [-1], max_tokens INT32 [1], adapter_id BYTES [1],
            sampling_parameters BYTES [1] (JSON), stream BOOL [1]  ->  output_ids INT32, finish_reason BYTES
    text    the `ensemble` (Triton vLLM backend I/O): text_input BYTES [1], stream BOOL [1],
            sampling_parameters BYTES [1] (JSON), exclude_input_in_output BOOL [1],
            return_num_output_tokens BOOL [1]  ->  text_output BYTES, num_output_tokens UINT32 (this response's)

Tokens of a text response are counted from num_output_tokens where the server sends it (exact), else by
tokenizing the text (exact for perf/make_model.py's word-level tokenizer, except for special tokens that the
server's detokenizer skips).

The adapter goes where `adapter_via` says: an input (`adapter_id`), a request parameter (`lora_name` or
`adapter_id`), or a field of sampling_parameters. Inputs the served model does not declare are left out (its
config is read once, see ModelIO), so the client keeps working while the model repository evolves.

A request's stream has ended when a response carries `triton_final_response`, or a non-empty finish_reason, or
once it has all the tokens it asked for (the trace's requests ignore EOS, so they get exactly max_tokens).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from perf.workload import TraceRequest

KINDS = ("tokens", "text")
TOKEN_OUTPUTS = ("output_ids", "finish_reason")  # what the tokens target reads
ADAPTER_VIA = ("input", "parameter", "sampling")


@dataclass(frozen=True)
class Target:
    model: str = "slora"
    kind: str = "tokens"
    adapter_via: str = "input"
    adapter_key: str = "adapter_id"  # the input, request parameter or sampling field that names the adapter

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.adapter_via not in ADAPTER_VIA:
            raise ValueError(f"adapter_via must be one of {ADAPTER_VIA}, got {self.adapter_via!r}")

    @classmethod
    def named(cls, name: str) -> Target:
        """The two models of our repository with their usual adapter routing."""
        presets = {
            "slora": cls("slora", "tokens", "input", "adapter_id"),
            "ensemble": cls("ensemble", "text", "sampling", "lora_name"),  # as Triton's vLLM backend takes it
        }
        if name not in presets:
            raise ValueError(f"unknown target {name!r} (known: {', '.join(presets)})")
        return presets[name]


@dataclass(frozen=True)
class ModelIO:
    """The served model's declared inputs and whether tensors carry a batch dimension (max_batch_size > 0)."""

    inputs: frozenset[str] | None = None  # None: unknown, send everything
    batched: bool = False

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelIO:
        config = config.get("config", config)
        names = frozenset(i["name"] for i in config.get("input", []))
        return cls(names or None, int(config.get("max_batch_size", 0) or 0) > 0)

    def declares(self, name: str) -> bool:
        return self.inputs is None or name in self.inputs


def encode(
    request: TraceRequest,
    request_id: str,
    target: Target,
    io: ModelIO,
    infer_input: Callable[[str, list[int], str], Any],
    text_of: Callable[[list[int]], str] | None = None,
    max_tokens: int | None = None,
    requested_output: Callable[[str], Any] | None = None,
) -> dict[str, Any]:
    """The dict that tritonclient's `stream_infer` iterator yields for one request.

    `infer_input` is tritonclient's InferInput class (passed in so that tests need no server); `text_of` renders
    prompt ids as text for the `text` kind; `max_tokens` overrides the request's output length (warm-up).
    With `requested_output` (tritonclient's InferRequestedOutput), a `tokens` request names the outputs it reads,
    TOKEN_OUTPUTS, as a token client would; the server then builds no text outputs for it.
    """
    sampling = {**request.sampling(), **({"max_tokens": max_tokens} if max_tokens else {})}
    tensors: dict[str, np.ndarray] = {}
    parameters: dict[str, Any] = {}
    if target.kind == "tokens":
        tensors["input_ids"] = np.asarray(request.prompt_ids, dtype=np.int32)
        if io.declares("max_tokens"):
            tensors["max_tokens"] = np.asarray([sampling["max_tokens"]], dtype=np.int32)
    else:
        if text_of is None:
            raise ValueError("the text target needs a tokenizer to render prompts")
        tensors["text_input"] = np.asarray([text_of(list(request.prompt_ids)).encode()], dtype=np.object_)
        for flag in ("exclude_input_in_output", "return_num_output_tokens", "return_finish_reason"):
            if io.inputs is not None and flag in io.inputs:
                tensors[flag] = np.asarray([True])
    if request.adapter is not None:
        if target.adapter_via == "input":
            tensors[target.adapter_key] = np.asarray([request.adapter.encode()], dtype=np.object_)
        elif target.adapter_via == "parameter":
            parameters[target.adapter_key] = request.adapter
        else:
            sampling[target.adapter_key] = request.adapter
    tensors["sampling_parameters"] = np.asarray([json.dumps(sampling).encode()], dtype=np.object_)
    tensors["stream"] = np.asarray([True])
    inputs = []
    for name, array in tensors.items():
        if not io.declares(name):
            continue
        if io.batched:
            array = array[None, ...]
        tensor = infer_input(name, list(array.shape), _datatype(array))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    request_dict = {"model_name": target.model, "inputs": inputs, "request_id": request_id,
                    "parameters": parameters or None}  # fmt: skip
    if requested_output is not None and target.kind == "tokens":
        request_dict["outputs"] = [requested_output(name) for name in TOKEN_OUTPUTS]
    return request_dict


def _datatype(array: np.ndarray) -> str:
    if array.dtype == np.object_:
        return "BYTES"
    return {np.dtype(np.int32): "INT32", np.dtype(np.bool_): "BOOL"}[array.dtype]


@dataclass
class StreamState:
    """What one request's stream has delivered so far (text kind: the text, to count tokens and strip echoes)."""

    expected_tokens: int
    prompt_text: str = ""
    tokens: int = 0
    text: str = ""
    echo_checked: bool = False
    finish_reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Chunk:
    num_tokens: int
    final: bool
    finish_reason: str | None = None


def decode(result: Any, target: Target, state: StreamState, count_tokens: Callable[[str], int]) -> Chunk:
    """Tokens carried by one streamed response, and whether the request's stream has ended."""
    if target.kind == "tokens":
        ids = result.as_numpy("output_ids")
        new = int(ids.size) if ids is not None else 0
    else:
        new = _text_tokens(result, state, count_tokens)
    state.tokens += new
    reason = _string(result.as_numpy("finish_reason"))
    final = _final_flag(result) or bool(reason) or state.tokens >= state.expected_tokens
    return Chunk(new, final, reason or None)


def _text_tokens(result: Any, state: StreamState, count_tokens: Callable[[str], int]) -> int:
    counted = result.as_numpy("num_output_tokens")
    if counted is not None and counted.size:
        return int(counted.reshape(-1).sum())
    text = _string(result.as_numpy("text_output"))
    if not text:
        return 0
    if state.text and text.startswith(state.text) and len(text) > len(state.text):
        text = text[len(state.text) :]  # the server sends the whole text so far, not a delta
    if not state.echo_checked:
        state.echo_checked = True
        if state.prompt_text and text.startswith(state.prompt_text):
            text = text[len(state.prompt_text) :]  # the prompt echoed before the output
    state.text += text
    return count_tokens(text) if text.strip() else 0


def _string(array: np.ndarray | None) -> str:
    if array is None or array.size == 0:
        return ""
    parts = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in array.reshape(-1)]
    return "".join(parts)


def _final_flag(result: Any) -> bool:
    try:
        params = result.get_response().parameters
    except AttributeError:
        return False
    return "triton_final_response" in params and bool(params["triton_final_response"].bool_param)
