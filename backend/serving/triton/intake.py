"""Triton generation requests → engine submissions: what the `slora` model and its peers (the alias) share.

A request is read into plain data (`raw_request`), parsed and checked once (request_inputs.py), registered with
the responder under a request id unique in the engine, and submitted; what the engine refuses comes back through
the responder. A request that cannot be parsed is answered at once with one error response, FINAL.
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import Any

import triton_python_backend_utils as pb_utils

from slora.backend.engine.tenants import tenant_of
from slora.backend.errors import EngineOverloadedError
from slora.backend.model.default_model import resolve_model_path
from slora.backend.model.tokenizer import load_tokenizer
from slora.backend.runtime.engine_service import EngineService
from slora.backend.runtime.messages import Submission
from slora.backend.serving.drain import DrainWatcher
from slora.backend.serving.options import ServingOptions
from slora.backend.serving.prompt import PromptEncoder
from slora.backend.serving.request_inputs import RawRequest, parse_generate
from slora.backend.serving.response_stream import OUTPUT_NAMES, ResponseStream
from slora.backend.serving.triton.errors import error_code, send_error
from slora.backend.serving.triton.responder import Responder

logger = logging.getLogger(__name__)

# Inputs read from a request (config.pbtxt declares them; the vLLM backend's return_* flags are accepted there and
# need no reading: finish_reason and the token counts are always sent).
INPUT_NAMES = ("text_input", "input_ids", "max_tokens", "adapter_id", "sampling_parameters", "stream",
               "exclude_input_in_output", "adapter_command", "adapter_path")  # fmt: skip


class Intake:
    def __init__(
        self,
        options: ServingOptions,
        responder: Responder,
        engine: EngineService,
        drain: DrainWatcher | None = None,
        id_suffix: str = "",
        declared: frozenset[str] = frozenset(OUTPUT_NAMES),
    ) -> None:
        """`declared`: the generation outputs the model's config.pbtxt declares (the alias has no output_ids)."""
        self.options = options
        self.encoder = prompt_encoder(options)
        self._responder = responder
        self._engine = engine
        self._drain = drain
        self._id_suffix = id_suffix  # a peer's: its ids never equal the engine model's own
        self._ids = itertools.count()
        self._declared = declared

    def submit(self, request: Any, sender: Any, raw: RawRequest, arrival: float) -> None:
        """Hand a well-formed request to the engine (raises for a malformed one: the caller answers it)."""
        if self._drain is not None and self._drain.draining:
            raise EngineOverloadedError("the server is shutting down")
        inputs = parse_generate(raw, self.encoder, self.options.default_max_tokens)
        request_id = f"{request.request_id() or 'req'}-{next(self._ids)}{self._id_suffix}"
        outputs = requested_outputs(request, inputs.is_text, self._declared)
        order = inputs.scheduling
        tenant = order.tenant if order.tenant is not None else tenant_of(None, inputs.adapter)  # the engine checks it
        stream = ResponseStream(inputs.stream, arrival, inputs.echo, outputs, tenant=tenant)
        self._responder.track(request_id, request, sender, stream)
        job = Submission(request_id, inputs.prompt_ids, inputs.adapter, inputs.sampling, "text_output" in outputs,
                         tenant=order.tenant, priority=order.priority, ttft_slo_s=order.ttft_slo_s)  # fmt: skip
        self._engine.submit(job)


def prompt_encoder(options: ServingOptions) -> PromptEncoder:
    """The tokenizer of text requests: the engine's (its `tokenizer` option, else the checkpoint's folder)."""
    path = options.engine.tokenizer or str(resolve_model_path(options.engine.model))
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        logger.warning("no tokenizer files in %s: serving token ids only; text requests (text_input, the ensemble) "
                       "need a tokenizer: start slora-serve with --tokenizer PATH", path)  # fmt: skip
    return PromptEncoder(tokenizer, options.apply_chat_template)


def raw_request(request: Any) -> RawRequest:
    tensors = {}
    for name in INPUT_NAMES:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            tensors[name] = tensor.as_numpy()
    text = request.parameters()
    parameters = json.loads(text) if text else {}
    return RawRequest(tensors, parameters)


def answer_error(sender: Any, exc: Exception) -> None:
    """End a request that was not accepted with one error response naming what is wrong."""
    code = error_code(exc)
    if code == pb_utils.TritonError.INTERNAL:
        logger.error("unexpected error while accepting a request", exc_info=exc)
    send_error(sender, str(exc), code)


def requested_outputs(
    request: Any, is_text: bool, declared: frozenset[str] = frozenset(OUTPUT_NAMES)
) -> frozenset[str]:
    """The generation outputs the client asked for, of those the model `declared`. When it named none (Triton then
    lists every output of the model, adapter_result too) or only unknown ones: all of them for a text request, all
    but text_output for a token request (its text is decoded only when asked for by name)."""
    requested = frozenset(request.requested_output_names() or ())
    names = requested & declared if "adapter_result" not in requested else frozenset()
    return names or frozenset(name for name in OUTPUT_NAMES if name in declared and (is_text or name != "text_output"))


def declared_outputs(model_config: dict[str, Any]) -> frozenset[str]:
    """The generation outputs (response_stream.OUTPUT_NAMES) that a model's config declares."""
    names = {output["name"] for output in model_config.get("output", [])}
    return frozenset(name for name in OUTPUT_NAMES if name in names)


def version_dir(args: dict[str, Any]) -> Path:
    return Path(args["model_repository"]) / str(args["model_version"])
