"""What the engine hands back: per-step request outputs, finished completions and engine statistics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestOutput:
    """New tokens (and text, when the engine has a tokenizer) of one request after one step. Not frozen: one is
    made per running request per step, and a frozen dataclass takes five times as long to build."""

    request_id: str
    new_token_ids: list[int]
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None  # set with finish_reason "error" when the engine failed this request
    exception: Exception | None = None  # the error itself, so that servers can map its kind to a status code

    def __reduce__(self) -> tuple[type[RequestOutput], tuple[object, ...]]:
        """Pickled as its fields in order: every step sends one a running request to the server's process, and a
        slotted dataclass's default state (a dict of field names a field) takes much longer (perf/RESULTS.md)."""
        return RequestOutput, (self.request_id, self.new_token_ids, self.text, self.finished, self.finish_reason,
                               self.num_prompt_tokens, self.num_output_tokens, self.error, self.exception)  # fmt: skip


@dataclass(frozen=True)
class Completion:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str


@dataclass(frozen=True)
class TenantStats:
    """One tenant as the scheduler sees it: its queue depth and the tokens served to it."""

    tenant: str
    weight: float
    waiting: int
    running: int
    prompt_tokens: int  # served since the engine started (or since the tenant was last forgotten, tenants.py)
    output_tokens: int
    counter: float | None = None  # the fair policy's virtual token counter (None under other policies)


@dataclass(frozen=True)
class EngineStats:
    pages_free: int
    pages_kv: int
    pages_adapter: int
    pages_total: int
    adapters_gpu: int
    adapters_host: int
    adapters_known: int
    running: int
    waiting: int
    adapter_loads: int
    adapter_evictions: int
    preemptions: int
    generated_tokens: int
    finished_requests: int
    engine_restarts: int = 0  # engine processes started again after one exited unexpectedly (engine_process.py)
    adapter_disk_reads: int = 0  # adapters read from disk into host memory
    adapter_host_evictions: int = 0  # adapters dropped from host memory to stay within its budget
    running_adapters: list[str] = field(default_factory=list)
    waiting_adapters: list[str] = field(default_factory=list)
    scheduling_policy: str = "fcfs"
    # Waiting requests refused by reason (backend/engine/slo.py): first-token deadline passed, first token expected
    # past the deadline (early abort), queue timeout.
    refused_ttft_slo: int = 0
    refused_ttft_slo_early: int = 0
    refused_queue_timeout: int = 0
    tenants: list[TenantStats] = field(default_factory=list)  # EngineConfig.tenant_stats_top, most queued first
    max_running: int = 0  # requests that may run at once now: max_num_seqs, or less while itl_slo_s caps it
    heavy_max_running: int = 0  # the batch a heavy tenant is admitted up to while others have work (fair, itl_slo_s)
    # The steps since the engine started, by kind (step_totals.py): decode steps, and steps that computed prompts.
    steps_decode: int = 0
    steps_prompt: int = 0
    step_seconds_decode: float = 0.0
    step_seconds_prompt: float = 0.0
    step_wall_seconds_decode: float = 0.0  # their intervals on the host (beyond step_seconds: the GPU waited)
    step_wall_seconds_prompt: float = 0.0
    step_copy_wait_seconds_decode: float = 0.0  # the device waiting ahead of them for adapter copies (CUDA)
    step_copy_wait_seconds_prompt: float = 0.0
    step_requests_decode: int = 0  # the steps' batch sizes, summed
    step_requests_prompt: int = 0
    step_graphs_decode: int = 0  # of the steps, those replayed as CUDA graphs
    step_graphs_prompt: int = 0
    step_prompt_tokens: int = 0
    # The process's garbage collections by generation (2: full) since the engine started: their count and the time
    # they held the GIL, every thread of the process stopped (backend/runtime/gc_pauses.py).
    gc_seconds_0: float = 0.0
    gc_seconds_1: float = 0.0
    gc_seconds_2: float = 0.0
    gc_collections_0: int = 0
    gc_collections_1: int = 0
    gc_collections_2: int = 0


def failed_output(request_id: str, exc: Exception, reason: str = "error") -> RequestOutput:
    """The final output of a request that failed ("error") or was refused before it ran ("rejected")."""
    return RequestOutput(request_id, [], finished=True, finish_reason=reason, error=str(exc), exception=exc)


# EngineStats fields that only grow over the life of a server (an engine process started again continues them).
STATS_COUNTERS = ("adapter_loads", "adapter_evictions", "preemptions", "generated_tokens", "finished_requests",
                  "adapter_disk_reads", "adapter_host_evictions", "refused_ttft_slo", "refused_ttft_slo_early",
                  "refused_queue_timeout", "steps_decode", "steps_prompt", "step_seconds_decode", "step_seconds_prompt",
                  "step_wall_seconds_decode", "step_wall_seconds_prompt", "step_copy_wait_seconds_decode",
                  "step_copy_wait_seconds_prompt", "step_requests_decode",
                  "step_requests_prompt", "step_graphs_decode", "step_graphs_prompt", "step_prompt_tokens",
                  "gc_seconds_0", "gc_seconds_1", "gc_seconds_2", "gc_collections_0", "gc_collections_1",
                  "gc_collections_2")  # fmt: skip
