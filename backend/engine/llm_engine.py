"""LLMEngine: one base model, many LoRA adapters, continuous batching. Usable without any server.

    engine = LLMEngine(EngineConfig(model="default", adapter_root="adapters/"))
    rid = engine.add_request("Hello", adapter="customer-a", sampling=SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step(): ...

Single-threaded: add_request, abort and step must come from one thread (engine_loop.py runs it in a thread of
its own for servers). `prepare` may be called from any thread: it checks the request and describes its adapter
(reading it into host memory while the budget has room) without touching the engine's state.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from slora.backend.adapters.store import AdapterInfo, AdapterStore
from slora.backend.config import EngineConfig, admit_when_copied, effective_admit_interval, overlap_enabled
from slora.backend.engine.batch_limit import BatchLimiter
from slora.backend.engine.detokenizer import IncrementalDetokenizer
from slora.backend.engine.inflight import InflightStep
from slora.backend.engine.outputs import Completion, EngineStats, RequestOutput, failed_output
from slora.backend.engine.request import FinishReason, Request
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.engine.scheduler import Scheduler, SchedulerLimits
from slora.backend.engine.scheduling_policy import check_priority, make_policy
from slora.backend.engine.slo import RefusalReason, SloGuard, SloSettings, check_ttft_slo, set_deadlines
from slora.backend.engine.start_memory import explained
from slora.backend.engine.startup import build_components
from slora.backend.engine.tenants import TenantBook, load_weights_file, tenant_of
from slora.backend.engine.warmup import warm_up
from slora.backend.errors import CapacityError, EngineOverloadedError, InvalidRequestError
from slora.backend.executor.model_runner import ModelRunner
from slora.backend.memory.adapter_cache import AdapterCache
from slora.backend.memory.page_pool import PageKind, PagePool
from slora.backend.model.spec import LORA_MODULES
from slora.backend.runtime.gc_pauses import PROCESS as GC_PAUSES

logger = logging.getLogger(__name__)

READ_AHEAD_SHARE = 4  # adapter reads ahead of admission hold at most 1/4 of the host budget (EngineConfig)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        try:
            self._start(config)
        except torch.OutOfMemoryError as exc:
            raise explained(exc, config, getattr(self, "pool", None)) from exc

    def _start(self, config: EngineConfig) -> None:
        parts = build_components(config)
        self.config = parts.config  # its "auto" options resolved (defaults.py)
        self.spec = parts.spec
        self.device = parts.device
        self.dtype = parts.dtype
        self.tokenizer = parts.tokenizer
        self.eos_token_ids = parts.eos_token_ids
        self.max_model_len = parts.max_model_len
        self.pool = parts.pool
        self.store = parts.store
        self.cache = parts.cache
        self.model = parts.model
        self.parallel = parts.parallel  # tensor parallelism: the other ranks' workers (backend/parallel/)
        c = self.config
        admit = effective_admit_interval(c)
        limits = SchedulerLimits(c.max_batch_tokens, c.max_num_seqs, c.prefetch_adapters, admit,
                                 admit_when_copied(c, self.device), c.adapter_read_ahead,
                                 parts.store.budget_bytes // READ_AHEAD_SHARE, c.max_bypass)  # fmt: skip
        self._limits = limits
        self.scheduler = _scheduler(c, limits, parts.pool, parts.cache, parts.store)
        self.runner = ModelRunner(self.model, self.pool, parts.graphs, parts.mixed_graphs)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seeds = torch.Generator().manual_seed(self.config.seed)
        self._seed_lock = threading.Lock()  # prepare() runs in callers' threads
        self._buffered: list[RequestOutput] = []
        self.overlap = overlap_enabled(self.config, self.device)
        self._inflight: InflightStep | None = None  # the launched step whose tokens are not read yet (overlap)
        self.generated_tokens = 0
        self.finished_requests = 0
        GC_PAUSES.install()  # the process's collections from here on, on the metrics port (gc_pauses.py)
        if self.config.preload_adapters:
            self.store.preload()
        self.capture_graphs_for_host_adapters()
        if self.config.warmup:
            warm_up(self)
            self._forget_warm_up()

    def _forget_warm_up(self) -> None:
        """Leave no trace of the warm-up's synthetic requests: a fresh scheduler (tenants' usage, fair counters,
        refusals, preemptions), zeroed totals and adapter load counts, request ids and sampling seeds from the
        start again; the engine then counts and samples as one that never warmed up."""
        self.scheduler = _scheduler(self.config, self._limits, self.pool, self.cache, self.store)
        self.cache.loads = self.cache.evictions = 0
        self.generated_tokens = self.finished_requests = 0
        self._ids = itertools.count()
        self._seeds = torch.Generator().manual_seed(self.config.seed)

    # ---- requests -------------------------------------------------------------------------------------------

    def prepare(
        self,
        prompt: str | Sequence[int],
        adapter: str | None = None,
        sampling: SamplingParams | dict[str, Any] | None = None,
        request_id: str | None = None,
        detokenize: bool = True,
        tenant: str | None = None,
        priority: int = 0,
        ttft_slo_s: float | None = None,
    ) -> Request:
        """Check a request, and read its adapter into host memory while the host budget has room (else the
        scheduler reads it ahead of its admission); raises InvalidRequestError/AdapterError.

        With `detokenize=False` (and no stop strings) outputs carry token ids only: no text is decoded.
        `tenant` (default: the adapter's name, or "<base>") is who it is served for under the `fair` policy;
        `priority` (higher first) orders it under `priority`; `ttft_slo_s` replaces EngineConfig.ttft_slo_s for
        it: a request still waiting when its first token can no longer come in time ends "rejected" (slo.py).
        Its deadlines count from now.
        """
        arrival = self.scheduler.clock()
        who = tenant_of(tenant, adapter)
        priority = check_priority(priority)
        ttft_slo_s = check_ttft_slo(ttft_slo_s)
        params = sampling if isinstance(sampling, SamplingParams) else SamplingParams.from_dict(sampling or {})
        prompt_ids = self._prompt_ids(prompt)
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the "
                f"model context of {self.max_model_len} tokens"
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer, and this model has none")
        ref = self.store.describe(adapter) if adapter else None
        if ref is not None:
            self.store.read_if_room(ref)
        self._check_capacity(total, ref.num_pages if ref else 0)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(params.seed if params.seed is not None else self._next_seed())
        wants_text = self.tokenizer is not None and (detokenize or bool(params.stop))
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop) if wants_text else None
        request = Request(
            request_id=request_id or f"req-{next(self._ids)}",  # itertools.count is atomic under the GIL
            token_ids=prompt_ids,
            num_prompt=len(prompt_ids),
            sampling=params,
            adapter=ref,
            generator=generator,
            detokenizer=detok,
            arrival_time=arrival,
            tenant=who,
            priority=priority,
        )
        set_deadlines(request, self.scheduler.guard.settings, ttft_slo_s)
        return request

    def submit(self, request: Request) -> str:
        """Queue a prepared request; raises EngineOverloadedError when the waiting queue is full."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise EngineOverloadedError(
                f"{len(self.scheduler.waiting)} requests are waiting (max_waiting={self.config.max_waiting}); "
                "try again later"
            )
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        return request.request_id

    def add_request(
        self,
        prompt: str | Sequence[int],
        adapter: str | None = None,
        sampling: SamplingParams | dict[str, Any] | None = None,
        request_id: str | None = None,
        detokenize: bool = True,
        tenant: str | None = None,
        priority: int = 0,
        ttft_slo_s: float | None = None,
    ) -> str:
        """prepare (see there for the arguments) and submit."""
        return self.submit(
            self.prepare(prompt, adapter, sampling, request_id, detokenize, tenant, priority, ttft_slo_s)
        )

    def set_tenant_weights(self, weights: dict[str, float], replace: bool = False) -> dict[str, float]:
        """Change tenants' weights (the `fair` policy's shares) from the next step on: merged into the current ones,
        or replacing them all with `replace`. Raises InvalidRequestError naming the tenant or weight (nothing is
        changed then). Returns every weight now set (tenants not in it weigh 1.0). Engine thread only."""
        return self.scheduler.book.set_weights(weights, replace)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its pages; returns its final output, or None if it is unknown/finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.release(request)
        request.finish_reason = FinishReason.ABORT
        self.finished_requests += 1
        return self._output(request, [], "")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the loop -------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, launch one forward and its sampling, and return what each touched request produced.

        With overlapped steps (EngineConfig.overlap_steps) the tokens returned are the previous step's, read
        back after this step is launched, so the host's work here runs while the GPU computes (inflight.py)."""
        outputs, self._buffered = self._buffered, []
        previous, self._inflight = self._inflight, None
        launched = self._launch(previous, outputs) if self.scheduler.has_work() else None
        if previous is not None:
            outputs += self._take(previous)
        if launched is not None and not self.overlap:
            outputs += self._take(launched)
        elif launched is not None:
            self._inflight = launched
        if not self.scheduler.running and self._inflight is None:
            self.check_idle_integrity()
        return outputs

    def _launch(self, previous: InflightStep | None, outputs: list[RequestOutput]) -> InflightStep | None:
        """Plan and launch a step; the final outputs of requests refused by the plan go to `outputs`."""
        plan = self.scheduler.schedule()
        for request, error in plan.refused:  # the scheduler already freed them
            del self.requests[request.request_id]
            self.finished_requests += 1
            outputs.append(failed_output(request.request_id, error, "rejected"))
        if not plan.seqs:
            if previous is None and not plan.refused and not plan.reading:
                raise RuntimeError("scheduler made no progress with work pending (pool accounting bug)")
            return None  # every running request's last token is in flight, or every waiting one was refused
        launched = self.runner.launch(plan.seqs, previous)
        for seq in plan.seqs:
            seq.request.num_computed += seq.num_tokens
        return launched

    def _take(self, step: InflightStep) -> list[RequestOutput]:
        """Read a launched step's tokens and append them; those of requests finished since it was launched (an
        abort, or a stop found in the step before) are dropped."""
        outputs = []
        tokens = self.runner.collect(step)
        self.scheduler.step_done(step.device_s, step.graph, step.copy_wait_s)
        now = time.monotonic()
        for request, token in tokens:
            if not request.finished:
                outputs.append(self._append_token(request, token, now))
        return outputs

    def _check_capacity(self, total_tokens: int, adapter_pages: int) -> None:
        """Raise CapacityError, naming the part of the pool that is too small, if a request of `total_tokens` with
        an adapter of `adapter_pages` could never be admitted."""
        kv = self.scheduler.pages_for(total_tokens)
        why = self.scheduler.never_fits(kv, adapter_pages)
        if why is None:
            return
        if self.pool.unified:
            raise CapacityError(
                f"request needs {kv + adapter_pages} pages (KV for {total_tokens} tokens + adapter), {why}"
            )
        raise CapacityError(
            f"request needs {kv} KV pages ({total_tokens} tokens) and {adapter_pages} adapter pages: {why}"
        )

    def capture_graphs_for_host_adapters(self) -> None:
        """With CUDA graphs: capture decode graphs (and those of steps with prompts) sized for the adapters now in
        host memory (their modules and largest rank), so that steps of them need no capture while serving (see
        cuda_graphs.py)."""
        graphs = self.runner.graphs
        if graphs is None:
            return
        loaded = [info.ranks for info in self.store.list() if info.in_host and info.ranks]
        if not loaded:
            return
        modules = frozenset(LORA_MODULES.index(m) for ranks in loaded for m, rank in ranks.items() if rank)
        max_rank = max(rank for ranks in loaded for rank in ranks.values())
        graphs.add_family(modules, max_rank)
        if self.runner.mixed_graphs is not None:
            self.runner.mixed_graphs.add_family(modules, max_rank)

    def evict_adapters(self) -> None:
        """Empty the pool of (unpinned) adapters, so that the next requests start cold on the GPU; the engine must
        be idle."""
        self.cache.evict(self.pool.num_pages_for(PageKind.ADAPTER))
        self.check_idle_integrity()

    def check_idle_integrity(self) -> None:
        """With nothing running, every page is free or holds an unpinned adapter (and with tensor parallelism,
        every rank's pool is checked against this one's)."""
        self.pool.check_integrity()
        if self.parallel is not None:
            self.parallel.check_integrity()
        if self.pool.count(PageKind.KV) != 0:
            raise AssertionError(f"{self.pool.count(PageKind.KV)} KV pages are held with no request running")

    def _append_token(self, request: Request, token: int, now: float) -> RequestOutput:
        request.first_token_time = request.first_token_time or now
        request.last_token_time = now
        request.token_ids.append(token)
        self.generated_tokens += 1
        params = request.sampling
        reason = None
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            reason = FinishReason.STOP
        elif request.detokenizer is not None:
            request.detokenizer.update(request.token_ids)
            if request.detokenizer.stopped:
                reason = FinishReason.STOP
        if reason is None and (request.num_output >= params.max_tokens or len(request.token_ids) >= self.max_model_len):
            reason = FinishReason.LENGTH
        text = request.detokenizer.take(final=reason is not None) if request.detokenizer else ""
        if reason is not None:
            request.finish_reason = reason
            self.scheduler.release(request)
            del self.requests[request.request_id]
            self.finished_requests += 1
        return self._output(request, [token], text)

    def _output(self, request: Request, tokens: list[int], text: str) -> RequestOutput:
        reason = request.finish_reason
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=tokens,
            text=text,
            finished=reason is not None,
            finish_reason=reason.value if reason is not None else None,
            num_prompt_tokens=request.num_prompt,
            num_output_tokens=request.num_output,
        )

    # ---- conveniences ---------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        adapters: Sequence[str | None] | None = None,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run all prompts together (one batch, continuous batching) and return them in order."""
        adapters = list(adapters) if adapters is not None else [None] * len(prompts)
        params = list(sampling) if isinstance(sampling, Sequence) else [sampling or SamplingParams()] * len(prompts)
        if not len(adapters) == len(params) == len(prompts):
            raise InvalidRequestError("prompts, adapters and sampling must have the same length")
        ids = [self.add_request(p, a, s) for p, a, s in zip(prompts, adapters, params)]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        texts: dict[str, list[str]] = {i: [] for i in ids}
        reasons: dict[str, str] = {}
        while any(i not in reasons for i in ids):
            for out in self.step():
                tokens[out.request_id] += out.new_token_ids
                texts[out.request_id].append(out.text)
                if out.finished:
                    reasons[out.request_id] = out.finish_reason or ""
        return [Completion(i, tokens[i], "".join(texts[i]), reasons[i]) for i in ids]

    def stream(
        self,
        prompt: str | Sequence[int],
        adapter: str | None = None,
        sampling: SamplingParams | dict[str, Any] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield one request's outputs as they come, stepping the engine; other requests' outputs are kept
        for the next `step()` call."""
        request_id = self.add_request(prompt, adapter, sampling)
        while True:
            for out in self.step():
                if out.request_id != request_id:
                    self._buffered.append(out)
                    continue
                yield out
                if out.finished:
                    return

    def stats(self) -> EngineStats:
        running = self.scheduler.running
        waiting = self.scheduler.waiting
        refusals = self.scheduler.refusals
        adapters_host, adapters_known = self.store.counts()
        return EngineStats(
            pages_free=self.pool.count(PageKind.FREE),
            pages_kv=self.pool.count(PageKind.KV),
            pages_adapter=self.pool.count(PageKind.ADAPTER),
            pages_total=self.pool.num_pages,
            adapters_gpu=len(self.cache),
            adapters_host=adapters_host,
            adapters_known=adapters_known,
            running=len(running),
            waiting=len(waiting),
            adapter_loads=self.cache.loads,
            adapter_evictions=self.cache.evictions,
            preemptions=self.scheduler.num_preemptions,
            generated_tokens=self.generated_tokens,
            finished_requests=self.finished_requests,
            adapter_disk_reads=self.store.loads,
            adapter_host_evictions=self.store.host_evictions,
            running_adapters=sorted({r.adapter_name for r in running if r.adapter_name}),
            waiting_adapters=sorted({r.adapter_name for r in waiting if r.adapter_name}),
            scheduling_policy=self.scheduler.policy.name,
            refused_ttft_slo=refusals[RefusalReason.TTFT_SLO.value],
            refused_ttft_slo_early=refusals[RefusalReason.TTFT_SLO_EARLY.value],
            refused_queue_timeout=refusals[RefusalReason.QUEUE_TIMEOUT.value],
            tenants=self.scheduler.tenant_stats(self.config.tenant_stats_top),
            max_running=self.scheduler.max_running(),
            heavy_max_running=self.scheduler.heavy_max_running(),
            **self.scheduler.step_totals.as_stats(),
            **GC_PAUSES.as_stats(),
        )

    def list_adapters(self) -> list[AdapterInfo]:
        return self.store.list()

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: send the prompt as token ids")
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=True))
        else:
            ids = list(prompt)
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.spec.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"input_ids: prompt token ids must be in [0, {self.spec.vocab_size}), got {bad[:5]}"
                )
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        return ids

    def _next_seed(self) -> int:
        with self._seed_lock:
            return int(torch.randint(0, 2**62, (1,), generator=self._seeds))


def _scheduler(
    config: EngineConfig, limits: SchedulerLimits, pool: PagePool, cache: AdapterCache, store: AdapterStore
) -> Scheduler:
    """The scheduler with the configured policy, tenant weights (read from their file now) and SLO settings."""
    weights = load_weights_file(config.tenant_weights_file) if config.tenant_weights_file else {}
    book = TenantBook(weights)
    policy = make_policy(config.scheduling_policy, book, config.fair_prompt_cost, config.fair_output_cost,
                         config.priority_aging_rate)  # fmt: skip
    guard = SloGuard(SloSettings(config.ttft_slo_s, config.queue_timeout_s, config.early_abort))
    limiter = BatchLimiter(config.itl_slo_s, limits.max_num_seqs) if config.itl_slo_s is not None else None
    if config.scheduling_policy == "fair" and limiter is None:
        logger.warning("scheduling_policy=fair without itl_slo_s: the queue is ordered by tenant, but a flood that "
                       "fits the batch still slows every tenant's tokens; set itl_slo_s (about 1.25 x the time per "
                       "output token at the usual load) to cap the batch (docs/serving.md)")  # fmt: skip
    return Scheduler(limits, pool, cache, policy, book, guard, hosts=store, limiter=limiter)
