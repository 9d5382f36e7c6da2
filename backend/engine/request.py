"""One generation request and its life: WAITING → RUNNING ⇄ (preempted) WAITING → FINISHED."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from slora.backend.adapters.host_adapter import AdapterRef
from slora.backend.engine.detokenizer import IncrementalDetokenizer
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.engine.tenants import BASE_TENANT
from slora.backend.memory.adapter_cache import ResidentAdapter


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"
    REJECTED = "rejected"  # refused while waiting: its first-token SLO or queue timeout could not be met (slo.py)


@dataclass(eq=False)
class Request:
    """Mutable state of one request. The scheduler owns `pages`, `resident` and `num_computed`."""

    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt: int
    sampling: SamplingParams
    adapter: AdapterRef | None = None  # which adapter, not its weights: the scheduler fetches those (store.py)
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed: int = 0  # tokens whose K/V are in `pages`
    num_inflight: int = 0  # tokens sampled by launched steps and not yet read back (overlapped steps, engine.py)
    pages: list[int] = field(default_factory=list)
    resident: ResidentAdapter | None = None  # pinned while running
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    tenant: str = BASE_TENANT  # who it is served for (tenants.py)
    priority: int = 0  # higher first, under the `priority` policy
    ttft_slo_s: float | None = None  # its first-token SLO (the request's own, else EngineConfig.ttft_slo_s)
    ttft_deadline: float | None = None  # arrival_time + ttft_slo_s: refused if still waiting with no token then
    queue_deadline: float | None = None  # arrival_time + EngineConfig.queue_timeout_s, for one never admitted

    @property
    def adapter_name(self) -> str | None:
        return self.adapter.name if self.adapter is not None else None

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens, counting those sampled on the device and not yet read back."""
        return len(self.token_ids) + self.num_inflight

    @property
    def num_pending(self) -> int:
        """Tokens whose K/V still have to be computed (the whole prompt, a chunk's rest, or the last sample)."""
        return self.num_tokens - self.num_computed

    @property
    def ends_in_flight(self) -> bool:
        """Its tokens still in flight reach max_tokens: it finishes when they are read, with nothing more to run."""
        return self.num_inflight > 0 and self.num_output + self.num_inflight >= self.sampling.max_tokens

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
