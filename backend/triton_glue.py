"""The `slora` Triton model: a decoupled Python-backend model that owns one engine in its stub process.

    execute(requests) ──► parse (request_inputs) ──► EngineLoop.submit ──► engine thread: step, step, ...
          │ returns at once                                              │ callbacks queue outputs
          └─ bad request: one error response, FINAL                      ▼
                                                     responder thread: responses (FINAL on the last),
                                                     client cancellation → abort (pages freed)

Control requests (`adapter_command` input: list | load | unload) are answered from a worker thread with one
response holding `adapter_result` (JSON). This module and the other `triton_*` modules are the only code that
imports triton_python_backend_utils; the engine knows nothing of Triton.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from slora.backend.adapter_admin import run_adapter_command
from slora.backend.engine import LLMEngine
from slora.backend.engine_loop import EngineLoop
from slora.backend.request_inputs import (
    RawRequest,
    is_adapter_command,
    parse_adapter_command,
    parse_generate,
)
from slora.backend.response_stream import OUTPUT_NAMES, ResponseStream
from slora.backend.serving_options import ServingOptions, model_config_parameters
from slora.backend.stub_compat import prepare_stub
from slora.backend.triton_errors import FINAL, error_code, send_error
from slora.backend.triton_logging import route_logging
from slora.backend.triton_metrics import NullMetrics, TritonMetrics
from slora.backend.triton_responder import Responder

logger = logging.getLogger(__name__)

INTAKE_THREADS = 4  # requests whose adapter must first be read from disk are taken in off Triton's thread


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        route_logging()
        try:
            prepare_stub()
        except RuntimeError as exc:
            raise pb_utils.TritonModelException(str(exc)) from exc
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise ValueError("the slora model must be decoupled (model_transaction_policy { decoupled: true })")
        version_dir = Path(args["model_repository"]) / str(args["model_version"])
        self.options = ServingOptions.from_parameters(model_config_parameters(model_config), version_dir)
        logger.info("starting the engine: %s", self.options.engine)
        started = time.monotonic()
        engine = LLMEngine(self.options.engine)
        self.loop = EngineLoop(engine)
        self.metrics = _metrics(self.options, engine)
        self.loop.step_listeners.append(lambda _engine, _outputs: self.metrics.update_stats(self.loop.stats()))
        self.responder = Responder(self.loop, self.metrics, self.options.cancel_check_s)
        self.admin = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slora-admin")
        self.intake = ThreadPoolExecutor(max_workers=INTAKE_THREADS, thread_name_prefix="slora-intake")
        self._ids = itertools.count()
        self.loop.start()
        logger.info("engine ready in %.1f s: %d pool pages, context %d tokens, %d adapters known",
                    time.monotonic() - started, engine.pool.num_pages, engine.max_model_len,
                    len(engine.list_adapters()))  # fmt: skip

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            self._accept(request)
        return None

    def finalize(self) -> None:
        logger.info("stopping the engine (%d requests in flight)", self.responder.in_flight())
        self.admin.shutdown(wait=True)
        self.intake.shutdown(wait=True)
        self.loop.stop()
        self.responder.stop()
        self.metrics.close()

    # ---- intake -----------------------------------------------------------------------------------------------

    def _accept(self, request: Any) -> None:
        arrival = time.monotonic()
        sender = request.get_response_sender()
        try:
            raw = _raw_request(request)
            if is_adapter_command(raw):
                command = parse_adapter_command(raw)  # errors answered at once
                self.admin.submit(self._run_command, request, sender, command)
                return
            self._submit(request, sender, raw, arrival)
        except Exception as exc:
            _send_error(sender, exc)

    def _submit(self, request: Any, sender: Any, raw: RawRequest, arrival: float) -> None:
        """Hand a request to the engine; if its adapter must be read from disk, do that in the intake pool so
        that the requests after it are taken in meanwhile."""
        inputs = parse_generate(raw, self.options.default_max_tokens)
        request_id = f"{request.request_id() or 'req'}-{next(self._ids)}"
        stream = ResponseStream(inputs.stream, arrival, inputs.prefix_text, requested_outputs(request))
        callback = self.responder.track(request_id, request, sender, stream)

        def submit() -> None:
            try:
                self.loop.submit(
                    inputs.prompt_ids, callback, inputs.adapter, inputs.sampling, request_id, inputs.wants_text
                )
            except Exception as exc:
                self.responder.forget(request_id)
                _send_error(sender, exc)

        if inputs.adapter and not self.loop.engine.store.in_host(inputs.adapter):
            self.intake.submit(submit)
        else:
            submit()

    def _run_command(self, request: Any, sender: Any, command: Any) -> None:
        try:
            if not self.options.adapter_admin:
                raise PermissionError("adapter commands are disabled on this server (adapter_admin=false)")
            result = run_adapter_command(self.loop, command)
            tensor = pb_utils.Tensor("adapter_result", np.asarray([json.dumps(result).encode()], dtype=np.object_))
            sender.send(pb_utils.InferenceResponse(output_tensors=[tensor]), flags=FINAL)
        except Exception as exc:
            _send_error(sender, exc)


def _metrics(options: ServingOptions, engine: LLMEngine) -> NullMetrics:
    try:
        return TritonMetrics(max_lora=engine.config.max_num_seqs, lora_info=options.lora_info_metric)
    except pb_utils.TritonModelException as exc:  # the server runs with --allow-metrics=false
        logger.info("metrics are off: %s", exc)
        return NullMetrics()


def _raw_request(request: Any) -> RawRequest:
    tensors = {}
    for name in ("input_ids", "max_tokens", "adapter_id", "sampling_parameters", "stream", "prefix_text",
                 "adapter_command", "adapter_path"):  # fmt: skip
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            tensors[name] = tensor.as_numpy()
    text = request.parameters()
    parameters = json.loads(text) if text else {}
    return RawRequest(tensors, parameters)


def _send_error(sender: Any, exc: Exception) -> None:
    code = error_code(exc)
    if code == pb_utils.TritonError.INTERNAL:
        logger.error("unexpected error while accepting a request", exc_info=exc)
    send_error(sender, str(exc), code)


def requested_outputs(request: Any) -> frozenset[str]:
    """The generation outputs the client asked for; all of them when it named none (or only unknown ones)."""
    names = frozenset(request.requested_output_names() or ()) & frozenset(OUTPUT_NAMES)
    return names or frozenset(OUTPUT_NAMES)
