"""What one Triton request to the `slora` model asks for: decoded and checked once, before the engine sees it.

The glue hands over plain data (input name → numpy array, request parameters as a dict); this module knows no
Triton. Every error is an InvalidRequestError whose message names the input, parameter or field at fault.

Where things may come from (the I/O of Triton's vLLM backend, plus our token-level inputs):

    prompt                either `text_input` (BYTES [1]: text, tokenized here by the PromptEncoder, with the
                          chat template when the `apply_chat_template` request parameter or the server's default
                          says so) or `input_ids` (INT32 [-1] token ids), not both
    adapter               `adapter_id` input, `adapter_id`/`lora_name` request parameter, or the
                          `adapter_id`/`lora_name` field of sampling_parameters; empty means the base model.
                          Two different non-empty names are an error.
    sampling              request parameters (as HTTP generate's "parameters" and the vLLM backend send them)
                          merged with the `sampling_parameters` JSON input; a key given twice with different
                          values is an error. Numbers sent as strings ("max_tokens": "128", as genai-perf does)
                          are read as numbers.
    max_tokens            `max_tokens` input, or the sampling field of that name
    tenant, priority,     request parameters or sampling_parameters fields of those names (the engine checks
    ttft_slo_s            them: backend/engine/tenants.py, scheduling_policy.py, slo.py); never sampling fields
    stream                `stream` BOOL input (default false: one response with every token)
    echo                  for text prompts, `exclude_input_in_output` (prompt.py): the prompt text put before
                          the first `text_output`
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.errors import InvalidRequestError
from slora.backend.runtime.messages import ADAPTER_OPS, AdapterCommand
from slora.backend.serving.prompt import PromptEncoder, parse_flag, prompt_echo

ADAPTER_KEYS = ("adapter_id", "lora_name")
# Request parameters that say how to read the prompt or run a command, never sampling parameters.
NOT_SAMPLING = frozenset({"apply_chat_template", "add_special_tokens", "adapter_path", "admin_token", "replace",
                          "tenant_weights"})  # fmt: skip
SCHEDULING_KEYS = ("tenant", "priority", "ttft_slo_s")  # taken out of the sampling fields for the scheduler
_INT_FIELDS = frozenset({"max_tokens", "top_k", "seed", "min_tokens", "n", "best_of", "priority"})
_FLOAT_FIELDS = frozenset({"temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                           "ttft_slo_s"})  # fmt: skip
_BOOL_FIELDS = frozenset({"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"})


@dataclass(frozen=True)
class RawRequest:
    """A Triton request as plain data: present inputs by name, and the request parameters."""

    tensors: Mapping[str, np.ndarray]
    parameters: Mapping[str, Any]


@dataclass(frozen=True)
class Scheduling:
    """Who a request is served for and how urgently; checked by the engine, which names a bad value."""

    tenant: str | None = None
    priority: Any = 0
    ttft_slo_s: Any = None


@dataclass(frozen=True)
class GenerateInputs:
    prompt_ids: list[int]
    adapter: str | None
    sampling: SamplingParams
    stream: bool
    is_text: bool = False  # the prompt came as text_input: the answer is text_output too
    echo: str = ""  # text to put before the first text_output (the prompt, for exclude_input_in_output=false)
    scheduling: Scheduling = field(default_factory=Scheduling)


def is_adapter_command(raw: RawRequest) -> bool:
    return "adapter_command" in raw.tensors


def parse_generate(
    raw: RawRequest, encoder: PromptEncoder | None = None, default_max_tokens: int | None = None
) -> GenerateInputs:
    """Decode a generation request; raises InvalidRequestError naming the input or field at fault."""
    sampling = _sampling_dict(raw)
    adapter = _adapter(raw, sampling)
    if "max_tokens" in raw.tensors:
        _merge(sampling, "max_tokens", _scalar(raw.tensors["max_tokens"], "max_tokens", int), "the max_tokens input")
    if "max_tokens" not in sampling and default_max_tokens is not None:
        sampling["max_tokens"] = default_max_tokens
    stream = bool(_scalar(raw.tensors["stream"], "stream", bool)) if "stream" in raw.tensors else False
    scheduling = Scheduling(**{key: sampling.pop(key) for key in SCHEDULING_KEYS if sampling.get(key) is not None})
    params = SamplingParams.from_dict(_vllm_compatible(sampling))
    if "text_input" not in raw.tensors:
        return GenerateInputs(_token_ids(raw), adapter, params, stream, scheduling=scheduling)
    if "input_ids" in raw.tensors:
        raise InvalidRequestError("give the prompt as 'text_input' or as 'input_ids', not both")
    text = _text(raw.tensors["text_input"], "text_input")
    exclude = _scalar(raw.tensors["exclude_input_in_output"], "exclude_input_in_output", bool) if (
        "exclude_input_in_output" in raw.tensors) else None  # fmt: skip
    echo = prompt_echo(text, stream, exclude)
    ids = (encoder or PromptEncoder(None)).encode(text, *_encoding_flags(raw))
    return GenerateInputs(ids, adapter, params, stream, is_text=True, echo=echo, scheduling=scheduling)


def parse_adapter_command(raw: RawRequest) -> AdapterCommand:
    op = _text(raw.tensors["adapter_command"], "adapter_command").strip().lower()
    if op not in ADAPTER_OPS:
        raise InvalidRequestError(f"adapter_command must be one of {', '.join(ADAPTER_OPS)}, got {op!r}")
    name = _adapter(raw, {})
    path = _optional_text(raw, "adapter_path")
    if op == "unload" and not name:
        raise InvalidRequestError("adapter_command 'unload' needs the adapter name (adapter_id)")
    if op == "load" and not name:
        raise InvalidRequestError("adapter_command 'load' needs the adapter name (adapter_id)")
    replace = parse_flag(raw.parameters.get("replace", False), "replace")
    return AdapterCommand(op, name, path or None, replace=replace, tenant_weights=_tenant_weights(raw, op))


def admin_token(raw: RawRequest) -> str | None:
    """The `admin_token` request parameter of a control request (checked by the glue against the server's)."""
    value = raw.parameters.get("admin_token")
    if value is not None and not isinstance(value, str):
        raise InvalidRequestError("request parameter 'admin_token' must be a string")
    return value


# ---- pieces ---------------------------------------------------------------------------------------------------


def _tenant_weights(raw: RawRequest, op: str) -> dict[str, Any] | None:
    """The `tenant_weights` request parameter (a JSON object {tenant: weight}) of a `tenant_weights` command."""
    value = raw.parameters.get("tenant_weights")
    if op != "tenant_weights":
        if value is not None:
            raise InvalidRequestError("request parameter 'tenant_weights' belongs to adapter_command 'tenant_weights'")
        return None
    if isinstance(value, str):
        value = _json_object(value, "request parameter 'tenant_weights'")
    if not isinstance(value, dict):
        raise InvalidRequestError("adapter_command 'tenant_weights' needs the request parameter 'tenant_weights': "
                                  'a JSON object {"tenant": weight, ...}')  # fmt: skip
    return value


def _json_object(text: str, where: str) -> Any:
    """Parsed JSON of `text`; bad or too deeply nested JSON is the client's error, named after `where`."""
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{where} is not valid JSON ({exc})") from exc
    except RecursionError:
        raise InvalidRequestError(f"{where} is nested too deeply") from None


def _encoding_flags(raw: RawRequest) -> tuple[bool | None, bool]:
    """(apply_chat_template: None = the server's default, add_special_tokens) from the request parameters."""
    chat = raw.parameters.get("apply_chat_template")
    special = raw.parameters.get("add_special_tokens", True)
    chat_template = None if chat is None else parse_flag(chat, "apply_chat_template")
    return chat_template, parse_flag(special, "add_special_tokens")


def _token_ids(raw: RawRequest) -> list[int]:
    if "input_ids" not in raw.tensors:
        raise InvalidRequestError(
            "the prompt is missing: give input 'text_input' (text) or 'input_ids' (INT32 token ids)"
        )
    array = raw.tensors["input_ids"]
    if array.dtype.kind not in "iu":
        raise InvalidRequestError(f"input 'input_ids' must hold integer token ids, got {array.dtype}")
    if array.ndim != 1:
        raise InvalidRequestError(f"input 'input_ids' must be 1-D [num_tokens], got shape {list(array.shape)}")
    return [int(t) for t in array.tolist()]


def _scalar(array: np.ndarray, name: str, kind: type) -> Any:
    if array.size != 1:
        raise InvalidRequestError(f"input {name!r} must hold exactly one value, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    if kind is bool:
        if array.dtype != np.bool_:
            raise InvalidRequestError(f"input {name!r} must be BOOL, got {array.dtype}")
        return bool(value)
    if array.dtype.kind not in "iu":
        raise InvalidRequestError(f"input {name!r} must be an integer, got {array.dtype}")
    return int(value)


def _text(array: np.ndarray, name: str) -> str:
    if array.size != 1:
        raise InvalidRequestError(f"input {name!r} must hold exactly one string, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequestError(f"input {name!r} is not valid UTF-8 ({exc})") from exc
    if isinstance(value, str):
        return value
    raise InvalidRequestError(f"input {name!r} must be a string (BYTES), got {type(value).__name__}")


def _optional_text(raw: RawRequest, name: str) -> str:
    if name in raw.tensors:
        return _text(raw.tensors[name], name)
    value = raw.parameters.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidRequestError(f"request parameter {name!r} must be a string, got {value!r}")
    return value or ""


def _sampling_dict(raw: RawRequest) -> dict[str, Any]:
    """Request parameters and the sampling_parameters JSON, merged; conflicting duplicates are refused."""
    merged = {
        key: _coerce(key, value)
        for key, value in raw.parameters.items()
        if not key.startswith("triton_") and key not in NOT_SAMPLING
    }
    if "sampling_parameters" in raw.tensors:
        text = _text(raw.tensors["sampling_parameters"], "sampling_parameters")
        values = _json_object(text, "input 'sampling_parameters'")
        if not isinstance(values, dict):
            raise InvalidRequestError(f"input 'sampling_parameters' must be a JSON object, got {type(values).__name__}")
        for key, value in values.items():
            _merge(merged, key, value, "sampling_parameters")
    return merged


def _merge(values: dict[str, Any], key: str, value: Any, source: str) -> None:
    value = _coerce(key, value)
    if key in values and values[key] is not None and value is not None and values[key] != value:
        raise InvalidRequestError(
            f"{key!r} is given twice with different values: {values[key]!r} and {value!r} ({source})"
        )
    if value is not None or key not in values:
        values[key] = value


def _adapter(raw: RawRequest, sampling: dict[str, Any]) -> str | None:
    """The one adapter named by the input, the request parameters or the sampling fields (popped)."""
    candidates: list[tuple[str, Any]] = []
    if "adapter_id" in raw.tensors:
        candidates.append(("input 'adapter_id'", _text(raw.tensors["adapter_id"], "adapter_id")))
    for key in ADAPTER_KEYS:
        if key in raw.parameters:
            candidates.append((f"request parameter {key!r}", raw.parameters[key]))
        if key in sampling:
            candidates.append((f"sampling parameter {key!r}", sampling.pop(key)))
    names: dict[str, str] = {}
    for where, value in candidates:
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise InvalidRequestError(f"{where} must be an adapter name (a string), got {value!r}")
        names.setdefault(value, where)
    if len(names) > 1:
        raise InvalidRequestError(
            "two different adapters are named: " + ", ".join(f"{name!r} ({where})" for name, where in names.items())
        )
    return next(iter(names), None)


def _vllm_compatible(values: dict[str, Any]) -> dict[str, Any]:
    """Accept what vLLM-style clients send: numbers as strings, min_tokens == max_tokens, logprobs=false."""
    out = {key: value for key, value in values.items() if value is not None}
    if out.get("logprobs") is False:
        del out["logprobs"]
    min_tokens = out.pop("min_tokens", 0)
    if min_tokens and min_tokens == out.get("max_tokens"):
        # Generate exactly max_tokens (genai-perf --output-tokens-mean-deterministic): never stop at EOS.
        out.setdefault("ignore_eos", True)
    elif min_tokens:
        out["min_tokens"] = min_tokens  # refused by SamplingParams with its own message
    return out


def _coerce(key: str, value: Any) -> Any:
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        if key in _INT_FIELDS:
            return int(text)
        if key in _FLOAT_FIELDS:
            return float(text)
    except ValueError:
        return value  # SamplingParams names the field and the bad value
    if key in _BOOL_FIELDS and text.lower() in ("true", "false"):
        return text.lower() == "true"
    return value
