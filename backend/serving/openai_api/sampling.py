"""A validated OpenAI request → the one slora request that serves it.

Sampling fields go into slora's `sampling_parameters` JSON under the engine's names (engine/sampling_params.py),
only when the client gave them, so that slora's defaults stay the defaults (max_tokens: slora-serve's
--default-max-tokens, else 16, as Triton's frontend and vLLM's SamplingParams default). The scheduling fields
(tenant, priority, ttft_slo_s) go as request parameters. A text prompt is tokenized by slora, once: completions
with the tokenizer's special tokens (as the engine and the ensemble encode a text prompt), chat prompts as rendered.
"""

from __future__ import annotations

from typing import Any

from slora.backend.serving.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from slora.backend.serving.openai_api.triton_client import SloraRequest

_SAMPLING = ("temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "stop_token_ids")
_SCHEDULING = ("tenant", "priority", "ttft_slo_s")


def completion_request(request: CompletionRequest, request_id: str, adapter: str | None) -> SloraRequest:
    sampling = _sampling(request, request.max_tokens)
    parameters = _parameters(request, add_special_tokens=True)
    return SloraRequest(request_id, request.prompt, adapter, sampling, request.stream, parameters)


def chat_request(request: ChatCompletionRequest, request_id: str, adapter: str | None, prompt: str) -> SloraRequest:
    sampling = _sampling(request, request.token_limit)
    parameters = _parameters(request, add_special_tokens=False)
    return SloraRequest(request_id, prompt, adapter, sampling, request.stream, parameters)


def _sampling(request: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> dict[str, Any]:
    sampling = {key: getattr(request, key) for key in _SAMPLING if getattr(request, key) is not None}
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    return sampling


def _parameters(
    request: CompletionRequest | ChatCompletionRequest, add_special_tokens: bool
) -> dict[str, str | int | float | bool]:
    # apply_chat_template=false: slora-serve --chat-template must not wrap a prompt a second time.
    parameters: dict[str, str | int | float | bool] = {
        "apply_chat_template": False,
        "add_special_tokens": add_special_tokens,
    }
    for key in _SCHEDULING:
        value = getattr(request, key)
        if value is not None:
            parameters[key] = value
    return parameters
