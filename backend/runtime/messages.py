"""Every message that crosses the engine-process boundary, one dataclass each (engine_process.py ⇄ engine_worker.py).

    server ── requests pipe ──► SubmitMsg  AbortMsg  CommandMsg  StopMsg
    server ◄── outputs pipe ─── LogMsg  ReadyMsg  FailedMsg  OutputsMsg  ResultMsg  HeartbeatMsg  StoppedMsg  FatalMsg

    peer   ── its socket ──────► PeerHelloMsg, then SubmitMsg  AbortMsg  PeerEventsMsg  (peers.py, engine_peer.py)
    peer   ◄── its socket ────── PeerWelcomeMsg, then OutputsMsg (stats None)
    server ◄── outputs pipe ──── PeerEventsMsg (the peers' latencies, for the engine model's metrics)

Messages are pickled by multiprocessing; every field is plain data, an engine dataclass or an exception that
pickles (engine_worker.py replaces one that does not by a RuntimeError with its message).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

from slora.backend.engine.outputs import EngineStats, RequestOutput
from slora.backend.engine.sampling_params import SamplingParams

ADAPTER_OPS = ("list", "load", "unload", "tenant_weights")


@dataclass(frozen=True)
class Submission:
    """One generation request, checked for shape by the server, to be checked for content by the engine."""

    request_id: str
    prompt_ids: list[int]
    adapter: str | None = None
    sampling: SamplingParams | None = None
    detokenize: bool = True
    tenant: str | None = None  # who it is served for (default: the adapter's name; backend/engine/tenants.py)
    priority: int = 0  # higher first, under scheduling_policy=priority
    ttft_slo_s: float | None = None  # first-token SLO in seconds (default: EngineConfig.ttft_slo_s)


@dataclass(frozen=True)
class AdapterCommand:
    """An admin request: list the adapters, register (load) / unregister (unload) one, or set tenants' weights.

    `load` with a path of a name that exists (registered, or a folder of the adapter root) is refused with
    AdapterExistsError unless `replace`. `read=False` registers without reading the weights now: what a new
    engine process is given back after a restart (they were read and checked when first loaded).
    """

    op: str  # one of ADAPTER_OPS
    name: str | None = None
    path: str | None = None
    replace: bool = False
    read: bool = True
    tenant_weights: dict[str, Any] | None = None  # {tenant: weight} for op "tenant_weights" (merged, or all: replace)


@dataclass(frozen=True)
class EngineInfo:
    num_pages: int
    max_model_len: int
    adapters_known: int
    worker_pids: tuple[int, ...] = ()  # the tensor-parallel worker processes (ranks 1 ..), if any
    max_num_seqs: int = 0  # running requests at most, as resolved at start (EngineConfig's "auto" included)
    max_batch_tokens: int = 0  # tokens a step computes at most, as resolved at start


# ---- server → engine process -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SubmitMsg:
    job: Submission


@dataclass(frozen=True)
class AbortMsg:
    request_id: str


@dataclass(frozen=True)
class CommandMsg:
    call_id: int
    command: AdapterCommand


@dataclass(frozen=True)
class StopMsg:
    pass


ToEngine: TypeAlias = SubmitMsg | AbortMsg | CommandMsg | StopMsg


# ---- engine process → server -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogRecord:
    level: int
    logger: str
    message: str


@dataclass(frozen=True)
class LogMsg:
    records: list[LogRecord]


@dataclass(frozen=True)
class ReadyMsg:
    info: EngineInfo
    stats: EngineStats


@dataclass(frozen=True)
class FailedMsg:
    reason: str  # why the engine could not start


@dataclass(frozen=True)
class OutputsMsg:
    outputs: list[RequestOutput]
    stats: EngineStats | None  # the latest statistics, when a step ended since the last message


@dataclass(frozen=True)
class ResultMsg:
    call_id: int
    value: Any = None  # the command's answer, when error is None
    error: Exception | None = None


@dataclass(frozen=True)
class HeartbeatMsg:
    loop_beat_age_s: float  # how long ago the engine loop last went round (EngineLoop.beat_age)


@dataclass(frozen=True)
class StoppedMsg:
    pass


@dataclass(frozen=True)
class FatalMsg:
    reason: str  # why the engine process is about to exit (a tensor-parallel worker died): the requests' error


# ---- a peer model (another Triton model served by the same engine: peers.py) ⇄ the engine process ---------------


@dataclass(frozen=True)
class PeerHelloMsg:
    name: str  # the peer model's name, for the engine's log


@dataclass(frozen=True)
class PeerWelcomeMsg:
    info: EngineInfo
    serving: Any  # the engine model's ServingOptions: the peer takes text requests exactly as that model does


@dataclass(frozen=True)
class PeerEventsMsg:
    """A peer's request metrics (("ttft" | "itl", seconds), ("finished", reason)), reported by the engine model."""

    events: list[tuple[str, Any]]


FromEngine: TypeAlias = (
    LogMsg | ReadyMsg | FailedMsg | OutputsMsg | ResultMsg | HeartbeatMsg | StoppedMsg | FatalMsg | PeerEventsMsg
)
