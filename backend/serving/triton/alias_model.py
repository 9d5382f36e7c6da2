"""The `ensemble` Triton model: an alias of `slora` for clients of the earlier layout (genai-perf --backend vllm,
scripts), a peer of its engine rather than a second one (runtime/peers.py).

    execute(requests) ──► parse (request_inputs) ──► EnginePeer.submit ══ socket ══► slora's engine
                                                      responder thread ◄══ outputs of this model's requests ══

It takes the text I/O of Triton's vLLM backend exactly as `slora` does (the same parsing, with the options the
engine's welcome carries: tokenizer, chat template, default max_tokens) and answers from its own responder, so
its streamed responses never pass through a Triton ensemble scheduler or the `slora` stub. Its load waits until
the engine serves (`engine_wait_s`); while the engine restarts, its requests end with an error saying so and new
ones are refused (UNAVAILABLE). Its request latencies are counted in `slora`'s series.

Parameters (config.pbtxt): `engine_model` (default "slora"), `engine_wait_s` (default 3600).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import triton_python_backend_utils as pb_utils

from slora.backend.runtime.engine_peer import EnginePeer
from slora.backend.runtime.messages import PeerWelcomeMsg
from slora.backend.runtime.peers import peer_address
from slora.backend.serving import drain
from slora.backend.serving.drain import DrainWatcher
from slora.backend.serving.options import model_config_parameters
from slora.backend.serving.triton.intake import Intake, answer_error, declared_outputs, raw_request
from slora.backend.serving.triton.log_bridge import route_logging
from slora.backend.serving.triton.metrics import NullMetrics
from slora.backend.serving.triton.responder import Responder
from slora.backend.stub_compat import prepare_stub

logger = logging.getLogger(__name__)

DEFAULT_ENGINE_MODEL = "slora"
DEFAULT_ENGINE_WAIT_S = 3600.0  # a large checkpoint's load


class PeerMetrics(NullMetrics):
    """This model's request metrics, reported to the engine model's series through the engine."""

    def __init__(self, peer: EnginePeer) -> None:
        self._peer = peer

    def observe(self, kind: str, seconds: float, tenant: str | None = None) -> None:
        self._peer.report(kind, seconds)
        if kind == "ttft" and tenant is not None:
            self._peer.report("tenant_ttft", (tenant, seconds))

    def responder_busy(self, seconds: float) -> None:
        self._peer.report("responder_busy", seconds)

    def count_finished(self, reason: str) -> None:
        self._peer.report("finished", reason)


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        route_logging()
        try:
            prepare_stub()
        except RuntimeError as exc:
            raise pb_utils.TritonModelException(str(exc)) from exc
        model_config = json.loads(args["model_config"])
        self.name = str(args["model_name"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise ValueError(f"{self.name} must be decoupled (model_transaction_policy {{ decoupled: true }})")
        parameters = model_config_parameters(model_config)
        engine_model = parameters.get("engine_model") or DEFAULT_ENGINE_MODEL
        wait_s = _seconds(parameters.get("engine_wait_s") or str(DEFAULT_ENGINE_WAIT_S), "engine_wait_s")
        self.outputs = declared_outputs(model_config)
        self.intake: Intake | None = None
        self.drain: DrainWatcher | None = None
        self.responder = Responder()
        address = peer_address(Path(args["model_repository"]).parent, engine_model)
        logger.info("%s: waiting for the engine of model %r (up to %.0f s)", self.name, engine_model, wait_s)
        self.engine = EnginePeer(address, self.name, engine_model, self.responder, self._welcome)
        if not self.engine.wait_connected(wait_s):
            self.engine.stop()
            if self.engine.failure is not None:
                raise pb_utils.TritonModelException(f"the {self.name} model cannot serve: {self.engine.failure}")
            raise pb_utils.TritonModelException(
                f"the {self.name} model serves through the engine of model {engine_model!r}, which did not serve "
                f"within engine_wait_s={wait_s:g} s: load {engine_model!r} from the same model repository"
            )

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            self._accept(request)
        return None

    def finalize(self) -> None:
        logger.info("stopping %s (%d requests in flight)", self.name, self.responder.in_flight())
        if self.drain is not None:
            self.drain.close()
            drain.leave(self.drain.drain_file, self.name)
        self.engine.stop()
        self.responder.stop()

    def _accept(self, request: Any) -> None:
        arrival = time.monotonic()
        sender = request.get_response_sender()
        try:
            intake = self.intake
            if intake is None:
                raise RuntimeError(f"the {self.name} model is still starting")
            intake.submit(request, sender, raw_request(request), arrival)
        except Exception as exc:
            answer_error(sender, exc)

    def _welcome(self, welcome: PeerWelcomeMsg) -> None:
        """The engine's welcome (on the connector thread): the first one readies this model; later ones come from
        an engine process started again, which takes the requests as before."""
        if self.intake is not None:
            return
        options = welcome.serving
        if options.drain_file:
            drain.join(Path(options.drain_file), self.name)
            self.drain = DrainWatcher(Path(options.drain_file), self.responder, peer=self.name)
        self.responder.serve(self.engine, PeerMetrics(self.engine), options.cancel_check_s)
        # Ids end with this model's name and process: unique beside the engine model's and a reloaded alias's
        suffix = f"~{self.name}.{os.getpid()}"
        self.intake = Intake(options, self.responder, self.engine, self.drain, suffix, self.outputs)
        logger.info("%s: serving through the engine of %d pool pages, %d adapters known", self.name,
                    welcome.info.num_pages, welcome.info.adapters_known)  # fmt: skip


def _seconds(text: str, name: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise ValueError(f"{name} must be a number of seconds, got {text!r}") from exc
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {text!r}")
    return value
