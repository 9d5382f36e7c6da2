"""The `preprocessing` and `postprocessing` Triton models of the ensemble (text ↔ token ids), stateless.

    preprocessing:  text_input, stream?, exclude_input_in_output?, return_*? ─► input_ids, prefix_text
    postprocessing: text_span_ids, text_spans, prefix_text, finish_reason, num_*_tokens ─► text_output, ...

Triton refuses an ensemble step whose inputs come from a decoupled step and from elsewhere, so postprocessing
reads only what `slora` sends; the prompt to echo travels through `slora` as `prefix_text`. The `return_*`
inputs of the vLLM backend's interface are accepted by preprocessing (finish_reason and the token counts are
always returned). Parameters: `tokenizer` (a folder), `apply_chat_template` (default for requests; a request
may set the `apply_chat_template` parameter).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from slora.backend.errors import SloraError
from slora.backend.model.default_model import resolve_model_path
from slora.backend.serving.options import model_config_parameters
from slora.backend.serving.text_steps import decode_spans, encode_prompt, load_tokenizer, parse_flag, prompt_prefix
from slora.backend.serving.triton.log_bridge import route_logging
from slora.backend.stub_compat import prepare_stub

logger = logging.getLogger(__name__)


def _tokenizer(args: dict[str, Any]) -> tuple[Any, dict[str, str]]:
    route_logging()
    prepare_stub()
    parameters = model_config_parameters(json.loads(args["model_config"]))
    path = parameters.get("tokenizer") or str(resolve_model_path(parameters.get("model") or "default"))
    logger.info("%s: loading the tokenizer from %s", args["model_name"], path)
    return load_tokenizer(path), parameters


def _optional_bool(request: Any, name: str) -> bool | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else bool(tensor.as_numpy().reshape(-1)[0])


def _error_response(exc: Exception) -> Any:
    if not isinstance(exc, (SloraError, ValueError)):
        logger.exception("text step failed")
    code = (
        pb_utils.TritonError.INVALID_ARG if isinstance(exc, (SloraError, ValueError)) else pb_utils.TritonError.INTERNAL
    )
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc), code))


def _bytes(values: list[str]) -> np.ndarray:
    return np.asarray([v.encode() for v in values], dtype=np.object_)


class _OneResponsePerRequest:
    """Answer each request of a batch on its own: a bad one gets its error, the others their results."""

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except Exception as exc:
                responses.append(_error_response(exc))
        return responses

    def _one(self, request: Any) -> Any:
        raise NotImplementedError


class PreprocessingModel(_OneResponsePerRequest):
    def initialize(self, args: dict[str, Any]) -> None:
        self.tokenizer, parameters = _tokenizer(args)
        self.chat_template = parse_flag(parameters.get("apply_chat_template") or "false", "apply_chat_template")

    def _one(self, request: Any) -> Any:
        value = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
        text = value.decode("utf-8") if isinstance(value, bytes) else str(value)
        parameters = json.loads(request.parameters() or "{}")
        chat = parameters.get("apply_chat_template")
        chat_template = self.chat_template if chat is None else parse_flag(chat, "apply_chat_template")
        stream = bool(_optional_bool(request, "stream"))
        prefix = prompt_prefix(text, stream, _optional_bool(request, "exclude_input_in_output"))
        ids = encode_prompt(self.tokenizer, text, chat_template)
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor("input_ids", ids), pb_utils.Tensor("prefix_text", _bytes([prefix]))]
        )


class PostprocessingModel(_OneResponsePerRequest):
    def initialize(self, args: dict[str, Any]) -> None:
        self.tokenizer, _ = _tokenizer(args)

    def _one(self, request: Any) -> Any:
        def get(name: str) -> np.ndarray:
            return pb_utils.get_input_tensor_by_name(request, name).as_numpy()

        prefix = get("prefix_text").reshape(-1)[0]
        text = (prefix.decode("utf-8") if isinstance(prefix, bytes) else str(prefix)) + decode_spans(
            self.tokenizer, get("text_span_ids"), get("text_spans")
        )
        tensors = [pb_utils.Tensor("text_output", _bytes([text]))]
        for name in ("finish_reason", "num_input_tokens", "num_output_tokens"):
            tensors.append(pb_utils.Tensor(name, get(name)))
        return pb_utils.InferenceResponse(output_tensors=tensors)
