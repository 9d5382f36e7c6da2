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
model drains (drain.py): it refuses new requests and ends every one in flight. Peer models of the repository (the
`ensemble` alias: alias_model.py) reach the same engine on its peer socket (runtime/peers.py).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from slora.backend.runtime.engine_process import EngineProcess
from slora.backend.runtime.engine_service import EngineService, LocalEngine
from slora.backend.runtime.fresh_threads import FreshThreadExecutor
from slora.backend.runtime.messages import EngineInfo
from slora.backend.runtime.peers import (
    PeerHub,
    PeerSettings,
    RoutingSink,
    clear_load_failure,
    note_load_failure,
    open_hub,
    peer_address,
)
from slora.backend.serving.admin_guard import AdminGuard
from slora.backend.serving.drain import DrainWatcher
from slora.backend.serving.health import HealthReporter
from slora.backend.serving.options import ServingOptions, model_config_parameters
from slora.backend.serving.request_inputs import admin_token, is_adapter_command, parse_adapter_command
from slora.backend.serving.triton.errors import FINAL
from slora.backend.serving.triton.intake import Intake, answer_error, raw_request, version_dir
from slora.backend.serving.triton.log_bridge import route_logging
from slora.backend.serving.triton.metrics import NullMetrics, TritonMetrics
from slora.backend.serving.triton.responder import Responder
from slora.backend.stub_compat import prepare_stub

logger = logging.getLogger(__name__)


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
        self.options = ServingOptions.from_parameters(model_config_parameters(model_config), version_dir(args))
        address = peer_address(Path(args["model_repository"]).parent, args["model_name"])
        clear_load_failure(address)
        try:
            self._start(address)
        except BaseException as exc:
            note_load_failure(address, f"{type(exc).__name__}: {exc}")
            raise

    def _start(self, address: str) -> None:
        """The engine and what serves it, per self.options; peers reach it at `address`."""
        if self.options.failed_reason:  # slora-serve keeps a model whose engine will not serve again unloadable
            raise pb_utils.TritonModelException(f"the engine does not serve: {self.options.failed_reason}")
        where = "in a process of its own" if self.options.engine_process else "in the stub process"
        logger.info("starting the engine %s: %s", where, self.options.engine)
        started = time.monotonic()
        self.responder = Responder(self.options.cancel_check_s)  # the engine's sink: the one request table here
        peers = PeerSettings(address, self.options)
        self.engine, self.peers = _start_engine(self.options, self.responder, peers)
        self.metrics = _metrics(self.options, self.engine.info)
        self.engine.on_stats(self.metrics.update_stats)
        _hear_peers(self.engine, self.peers, self.metrics)
        health_file = Path(self.options.health_file) if self.options.health_file else None
        self.health = HealthReporter(self.engine.health, health_file, self.metrics.set_serving)
        self.responder.serve(self.engine, self.metrics)
        self.drain = DrainWatcher(Path(self.options.drain_file), self.responder) if self.options.drain_file else None
        self.intake = Intake(self.options, self.responder, self.engine, self.drain)
        self.admin = FreshThreadExecutor(max_workers=1, thread_name_prefix="slora-admin")  # adapter reads: see there
        self.admin_guard = AdminGuard.from_options(self.options)
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
        if self.peers is not None:
            self.peers.close()
        self.responder.stop()
        self.metrics.close()

    def _accept(self, request: Any) -> None:
        arrival = time.monotonic()
        sender = request.get_response_sender()
        try:
            raw = raw_request(request)
            if is_adapter_command(raw):
                command = parse_adapter_command(raw)  # errors answered at once
                self.admin_guard.check(admin_token(raw), command.op)
                self.admin.submit(self._run_command, request, sender, command)
                return
            self.intake.submit(request, sender, raw, arrival)
        except Exception as exc:
            answer_error(sender, exc)

    def _run_command(self, request: Any, sender: Any, command: Any) -> None:
        try:
            result = self.engine.command(command)
            tensor = pb_utils.Tensor("adapter_result", np.asarray([json.dumps(result).encode()], dtype=np.object_))
            sender.send(pb_utils.InferenceResponse(output_tensors=[tensor]), flags=FINAL)
        except Exception as exc:
            answer_error(sender, exc)


def _start_engine(
    options: ServingOptions, sink: Responder, peers: PeerSettings
) -> tuple[EngineService, PeerHub | None]:
    """The engine, and where it takes its peers' requests: in its process, or here beside it (engine_process=false)."""
    if options.engine_process:
        engine = EngineProcess(
            options.engine,
            sink,
            max_restarts=options.in_stub_restarts,
            write_back_registry=options.lora_registry_write_back,
            watchdog_s=options.watchdog_s,
            registry_journal=options.registry_journal,
            restarts_before=options.engine_restarts,
            peer=peers,
        )
        return engine, None
    router = RoutingSink(sink)
    local = LocalEngine.start(options.engine, router, watchdog_s=options.watchdog_s)
    return local, open_hub(peers, local, router)


def _hear_peers(engine: EngineService, hub: PeerHub | None, metrics: NullMetrics) -> None:
    """The peers' request metrics go to this model's series, which then count every model's requests."""
    if hub is not None:
        hub.on_events = metrics.replay
    elif isinstance(engine, EngineProcess):
        engine.on_peer_events(metrics.replay)


def _metrics(options: ServingOptions, info: EngineInfo) -> NullMetrics:
    """The slora_* metrics; the engine's limits as resolved at start: max_num_seqs is also the LoRA gauge's
    max_lora."""
    limits = {"max_num_seqs": info.max_num_seqs, "max_batch_tokens": info.max_batch_tokens}
    try:
        return TritonMetrics(max_lora=info.max_num_seqs, lora_info=options.lora_info_metric,
                             tenant_ttft=options.engine.tenant_stats_top > 0, limits=limits)  # fmt: skip
    except pb_utils.TritonModelException as exc:  # the server runs with --allow-metrics=false
        logger.info("metrics are off: %s", exc)
        return NullMetrics()
