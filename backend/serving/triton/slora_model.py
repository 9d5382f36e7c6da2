"""The `slora` Triton model: a decoupled Python-backend model that serves one engine.

    execute(requests) ──► parse (request_inputs) ──► engine.submit ──► engine: step, step, ...
          │ returns at once                                        │ each step's outputs, to one sink
          └─ malformed request: one error response, FINAL          ▼
                                              responder thread: responses (FINAL on the last; refusals by the
                                              engine as errors), client cancellation → abort (pages freed)

The engine runs in a process of its own by default (`engine_process=true`, engine_process.py), so that its
Python work and the responder's do not share one GIL; `engine_process=false` runs it on a thread of the stub.
Text requests (`text_input`, the I/O of Triton's vLLM backend) are tokenized here, once, and answered with the
engine's own incremental text (`text_output`); token requests (`input_ids`) skip both ends. Control requests
(`adapter_command` input: list | load | unload) are answered from a worker thread with one response holding
`adapter_result` (JSON). This package (serving/triton/) holds the only code that imports
triton_python_backend_utils; the engine knows nothing of Triton. Before slora-serve stops the server, the
model drains (drain.py): it refuses new requests and ends every one in flight.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from slora.backend.errors import EngineOverloadedError
from slora.backend.model.default_model import resolve_model_path
from slora.backend.model.tokenizer import load_tokenizer
from slora.backend.runtime.engine_process import EngineProcess
from slora.backend.runtime.engine_service import EngineService, LocalEngine
from slora.backend.runtime.fresh_threads import FreshThreadExecutor
from slora.backend.runtime.messages import Submission
from slora.backend.serving.admin_guard import AdminGuard
from slora.backend.serving.drain import DrainWatcher
from slora.backend.serving.health import HealthReporter
from slora.backend.serving.options import ServingOptions, model_config_parameters
from slora.backend.serving.prompt import PromptEncoder
from slora.backend.serving.request_inputs import (
    RawRequest,
    admin_token,
    is_adapter_command,
    parse_adapter_command,
    parse_generate,
)
from slora.backend.serving.response_stream import OUTPUT_NAMES, ResponseStream
from slora.backend.serving.triton.errors import FINAL, error_code, send_error
from slora.backend.serving.triton.log_bridge import route_logging
from slora.backend.serving.triton.metrics import NullMetrics, TritonMetrics
from slora.backend.serving.triton.responder import Responder
from slora.backend.stub_compat import prepare_stub

logger = logging.getLogger(__name__)

# Inputs read from a request (config.pbtxt declares them; the vLLM backend's return_* flags are accepted there and
# need no reading: finish_reason and the token counts are always sent).
INPUT_NAMES = ("text_input", "input_ids", "max_tokens", "adapter_id", "sampling_parameters", "stream",
               "exclude_input_in_output", "adapter_command", "adapter_path")  # fmt: skip


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
        if self.options.failed_reason:  # slora-serve keeps a model whose engine will not serve again unloadable
            raise pb_utils.TritonModelException(f"the engine does not serve: {self.options.failed_reason}")
        where = "in a process of its own" if self.options.engine_process else "in the stub process"
        logger.info("starting the engine %s: %s", where, self.options.engine)
        started = time.monotonic()
        self.encoder = _prompt_encoder(self.options)
        self.responder = Responder(self.options.cancel_check_s)  # the engine's sink: the one request table here
        self.engine = _start_engine(self.options, self.responder)
        self.metrics = _metrics(self.options, self.engine.info.max_num_seqs)
        self.engine.on_stats(self.metrics.update_stats)
        health_file = Path(self.options.health_file) if self.options.health_file else None
        self.health = HealthReporter(self.engine.health, health_file, self.metrics.set_serving)
        self.responder.serve(self.engine, self.metrics)
        self.drain = DrainWatcher(Path(self.options.drain_file), self.responder) if self.options.drain_file else None
        self.admin = FreshThreadExecutor(max_workers=1, thread_name_prefix="slora-admin")  # adapter reads: see there
        self.admin_guard = AdminGuard.from_options(self.options)
        self._ids = itertools.count()
        info = self.engine.info
        logger.info("engine ready in %.1f s: %d pool pages, context %d tokens, %d adapters known",
                    time.monotonic() - started, info.num_pages, info.max_model_len, info.adapters_known)  # fmt: skip

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            self._accept(request)
        return None

    def finalize(self) -> None:
        logger.info("stopping the engine (%d requests in flight)", self.responder.in_flight())
        if self.drain is not None:
            self.drain.close()
        self.admin.shutdown(wait=True)
        self.health.close()
        self.engine.stop()
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
                self.admin_guard.check(admin_token(raw), command.op)
                self.admin.submit(self._run_command, request, sender, command)
                return
            self._submit(request, sender, raw, arrival)
        except Exception as exc:
            _send_error(sender, exc)

    def _submit(self, request: Any, sender: Any, raw: RawRequest, arrival: float) -> None:
        """Hand a well-formed request to the engine; what the engine refuses comes back through the responder."""
        if self.drain is not None and self.drain.draining:
            raise EngineOverloadedError("the server is shutting down")
        inputs = parse_generate(raw, self.encoder, self.options.default_max_tokens)
        request_id = f"{request.request_id() or 'req'}-{next(self._ids)}"
        outputs = requested_outputs(request, inputs.is_text)
        stream = ResponseStream(inputs.stream, arrival, inputs.echo, outputs)
        self.responder.track(request_id, request, sender, stream)
        wants_text = "text_output" in outputs
        order = inputs.scheduling
        job = Submission(request_id, inputs.prompt_ids, inputs.adapter, inputs.sampling, wants_text,
                         tenant=order.tenant, priority=order.priority, ttft_slo_s=order.ttft_slo_s)  # fmt: skip
        self.engine.submit(job)

    def _run_command(self, request: Any, sender: Any, command: Any) -> None:
        try:
            result = self.engine.command(command)
            tensor = pb_utils.Tensor("adapter_result", np.asarray([json.dumps(result).encode()], dtype=np.object_))
            sender.send(pb_utils.InferenceResponse(output_tensors=[tensor]), flags=FINAL)
        except Exception as exc:
            _send_error(sender, exc)


def _start_engine(options: ServingOptions, sink: Responder) -> EngineService:
    if options.engine_process:
        return EngineProcess(
            options.engine,
            sink,
            max_restarts=options.in_stub_restarts,
            write_back_registry=options.lora_registry_write_back,
            watchdog_s=options.watchdog_s,
            registry_journal=options.registry_journal,
            restarts_before=options.engine_restarts,
        )
    return LocalEngine.start(options.engine, sink, watchdog_s=options.watchdog_s)


def _prompt_encoder(options: ServingOptions) -> PromptEncoder:
    """The tokenizer of text requests: the engine's (its `tokenizer` option, else the checkpoint's folder)."""
    path = options.engine.tokenizer or str(resolve_model_path(options.engine.model))
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        logger.warning("no tokenizer files in %s: serving token ids only; text requests (text_input, the ensemble) "
                       "need a tokenizer: start slora-serve with --tokenizer PATH", path)  # fmt: skip
    return PromptEncoder(tokenizer, options.apply_chat_template)


def _metrics(options: ServingOptions, max_num_seqs: int) -> NullMetrics:
    """The slora_* metrics; `max_num_seqs` (the engine's, resolved) is the LoRA gauge's max_lora."""
    try:
        return TritonMetrics(max_lora=max_num_seqs, lora_info=options.lora_info_metric)
    except pb_utils.TritonModelException as exc:  # the server runs with --allow-metrics=false
        logger.info("metrics are off: %s", exc)
        return NullMetrics()


def _raw_request(request: Any) -> RawRequest:
    tensors = {}
    for name in INPUT_NAMES:
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


def requested_outputs(request: Any, is_text: bool) -> frozenset[str]:
    """The generation outputs the client asked for. When it named none (Triton then lists every output of the
    model, adapter_result too) or only unknown ones: all of them for a text request, all but text_output for a
    token request (its text is decoded only when asked for by name)."""
    requested = frozenset(request.requested_output_names() or ())
    names = requested & frozenset(OUTPUT_NAMES) if "adapter_result" not in requested else frozenset()
    return names or frozenset(name for name in OUTPUT_NAMES if is_text or name != "text_output")
