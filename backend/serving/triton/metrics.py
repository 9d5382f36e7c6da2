"""The `slora_*` metrics on Triton's metrics port (pb_utils.MetricFamily), fed by the engine loop and responder.

    slora_pool_pages{kind="kv|adapter|free"}        gauge      pages of the unified pool by use
    slora_kv_cache_usage_ratio                      gauge      KV pages / all pages
    slora_adapters{tier="gpu|host|disk"}            gauge      adapters with a copy in the pool / in host memory /
                                                               known (registered or under the adapter root)
    slora_requests{state="running|waiting"}         gauge      requests in the batch / queued
    slora_max_running_requests                      gauge      requests the batch may hold now: max_num_seqs, or
                                                               less while itl_slo_s caps it (batch_limit.py)
    slora_heavy_max_running_requests                gauge      the batch a heavy tenant (a flood) is admitted up to
                                                               while other tenants have work: under fair with
                                                               itl_slo_s, the heavy tenants' step target's cap
                                                               (slot_shares.py); else as the line above
    slora_adapter_loads_total                       counter    adapter copies into the pool
    slora_adapter_evictions_total                   counter    adapters evicted from the pool
    slora_adapter_disk_reads_total                  counter    adapters read from disk into host memory
    slora_adapter_host_evictions_total              counter    adapters dropped from host memory (its budget)
    slora_preemptions_total                         counter    requests preempted (pool full) and recomputed
    slora_generated_tokens_total                    counter    tokens sampled
    slora_engine_restarts_total                     counter    engine processes started again after a crash
    slora_engine_serving                            gauge      1 while the engine serves, 0 while it restarts or
                                                               has failed (the model's readiness follows it)
    slora_requests_finished_total{reason=...}       counter    reason: length|stop|abort|error|rejected
    slora_requests_refused_total{reason=...}        counter    refused by admission: ttft_slo (its deadline
                                                               passed), ttft_slo_early, queue_timeout
    slora_tenant_requests{tenant, state}            gauge      running / waiting requests of the busiest
                                                               tenants (EngineConfig.tenant_stats_top of them;
                                                               MAX_TENANT_SERIES tenants at most, ever)
    slora_tenant_tokens{tenant, kind}               gauge      prompt / output tokens served to each of them
    slora_time_to_first_token_seconds               histogram  arrival at the model → first token
    slora_tenant_time_to_first_token_seconds{tenant}  histogram  the same, per tenant (a request's `tenant`, else
                                                               its adapter, else <base>; MAX_TENANT_SERIES
                                                               tenants at most, ever; off with tenant_stats_top=0)
    slora_inter_token_latency_seconds               histogram  between two tokens of one request
    slora_first_response_delay_seconds              histogram  a streamed request's first token, from the engine's
                                                               output to its response sent: the responder's lag,
                                                               which the first-token histograms leave out
    slora_responder_busy_seconds_total              counter    time the responder threads spent sending responses
                                                               (over a window, its growth / the window: how busy)
    slora_engine_limit{limit}                       gauge      limit: max_num_seqs | max_batch_tokens, the batch
                                                               limits as resolved at start ("auto" included): what
                                                               a client's roofline of the server needs
    slora_steps_total{kind="decode|prompt"}          counter    engine steps: decode only, or computing prompt
                                                               tokens too (step_totals.py)
    slora_step_seconds_total{kind}                  counter    their time (on CUDA, on the device's stream)
    slora_step_wall_seconds_total{kind}             counter    their intervals on the host (step_totals.py): beyond
                                                               their time, the GPU waited for the host
    slora_step_copy_wait_seconds_total{kind}        counter    of that wait, the device's stream standing still
                                                               ahead of the steps for their new adapters' copies
                                                               (CUDA; 0 elsewhere)
    slora_step_requests_total{kind}                 counter    the requests they ran (batch sizes summed)
    slora_step_graphs_total{kind}                   counter    those of them replayed as CUDA graphs
    slora_step_prompt_tokens_total                  counter    prompt tokens they computed
    slora_gc_seconds_total{generation="0|1|2"}      counter    time the engine process's garbage collections held
                                                               the GIL, every thread (the loop that launches the
                                                               GPU's steps too) stopped; 2: full collections
    slora_gc_collections_total{generation}          counter    those collections
    vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}   gauge (opt-in)
        value: the Unix time of the update; read by the Gateway API Inference Extension's endpoint picker for
        LoRA affinity (its newest series by value). One series at a time: the current adapter sets. A Python-
        backend family keeps every series it ever made, so a new label set replaces the whole family (dropping
        a family removes its series from Triton's registry); the page stays one line long however many adapter
        sets the server goes through. The new family comes before the old one goes: a scrape between the two
        sees two series and the picker takes the newer, where a gap would tell it the replica runs no adapter.

Every update is a message to the server process, so updates are queued and made by one thread; gauges follow
the engine's statistics at most every `interval_s`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import triton_python_backend_utils as pb_utils

from slora.backend.engine.outputs import EngineStats
from slora.backend.engine.step_totals import KINDS as STEP_KINDS
from slora.backend.runtime.gc_pauses import GENERATIONS as GC_GENERATIONS

logger = logging.getLogger(__name__)

# 10 ms steps to 0.1 s: unloaded first tokens on a GPU take tens of ms, and a quantile is interpolated in its bucket.
TTFT_BUCKETS = [0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                2.5, 5.0, 10.0, 30.0, 60.0]  # fmt: skip
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
DELAY_BUCKETS = [0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0]
REQUEST_EVENTS = ("ttft", "itl", "tenant_ttft", "first_response_delay", "responder_busy", "finished")  # a peer's
FINISH_REASONS = ("length", "stop", "abort", "error", "rejected")
REFUSAL_REASONS = ("ttft_slo", "ttft_slo_early", "queue_timeout")  # EngineStats.refused_<reason>
MAX_TENANT_SERIES = 256  # tenants with series of their own, in the server's life
ENGINE_LIMITS = ("max_num_seqs", "max_batch_tokens")  # slora_engine_limit's labels
LORA_INFO_METRIC = "vllm:lora_requests_info"


class NullMetrics:
    """Used when the server runs without metrics."""

    def update_stats(self, stats: EngineStats) -> None:
        pass

    def observe(self, kind: str, seconds: float, tenant: str | None = None) -> None:
        """A request's latency: kind "ttft" (its tenant's too, where given), "itl" or "first_response_delay"."""

    def responder_busy(self, seconds: float) -> None:
        """Time a responder thread spent on one batch of outputs."""

    def count_finished(self, reason: str) -> None:
        pass

    def set_serving(self, serving: bool) -> None:
        pass

    def replay(self, events: list[tuple[str, Any]]) -> None:
        """Request metrics observed by a peer model (("ttft" | "itl" | "first_response_delay" | "responder_busy",
        seconds), ("tenant_ttft", (tenant, seconds)), ("finished", reason))."""

    def close(self) -> None:
        pass


class TritonMetrics(NullMetrics):
    def __init__(
        self,
        max_lora: int,
        lora_info: bool,
        interval_s: float = 0.1,
        tenant_ttft: bool = True,
        limits: dict[str, int] | None = None,
    ) -> None:
        """limits: the engine's batch limits by name (ENGINE_LIMITS), as resolved at start; 0 or absent: unknown."""
        self._families: list[Any] = []
        self._max_lora = max_lora
        gauge, counter, histogram = (pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER,
                                     pb_utils.MetricFamily.HISTOGRAM)  # fmt: skip
        pages = self._family("slora_pool_pages", "Pages of the unified page pool by use", gauge)
        self.pages = {kind: pages.Metric(labels={"kind": kind}) for kind in ("kv", "adapter", "free")}
        self.kv_usage = self._family("slora_kv_cache_usage_ratio", "KV pages / all pool pages", gauge).Metric(labels={})
        adapters = self._family("slora_adapters", "Adapters with a copy in each tier", gauge)
        self.adapters = {tier: adapters.Metric(labels={"tier": tier}) for tier in ("gpu", "host", "disk")}
        requests = self._family("slora_requests", "Requests running in the batch or waiting", gauge)
        self.requests = {state: requests.Metric(labels={"state": state}) for state in ("running", "waiting")}
        self.max_running = self._family(
            "slora_max_running_requests", "Requests the batch may hold now (max_num_seqs, or the itl_slo_s cap)", gauge
        ).Metric(labels={})
        self.limits = self._limit_gauges(limits or {}, gauge)
        self.heavy_max_running = self._family(
            "slora_heavy_max_running_requests",
            "The batch a heavy tenant is admitted up to while other tenants have work (fair with itl_slo_s)",
            gauge,
        ).Metric(labels={})
        self.counters = {
            "adapter_loads": self._family("slora_adapter_loads_total", "Adapter copies into the pool", counter),
            "adapter_evictions": self._family(
                "slora_adapter_evictions_total", "Adapters evicted from the pool", counter
            ),
            "adapter_disk_reads": self._family(
                "slora_adapter_disk_reads_total", "Adapters read from disk into host memory", counter
            ),
            "adapter_host_evictions": self._family(
                "slora_adapter_host_evictions_total", "Adapters dropped from host memory for its budget", counter
            ),
            "preemptions": self._family("slora_preemptions_total", "Requests preempted and recomputed", counter),
            "generated_tokens": self._family("slora_generated_tokens_total", "Tokens generated", counter),
            "engine_restarts": self._family(
                "slora_engine_restarts_total", "Engine processes started again after one exited unexpectedly", counter
            ),
        }
        labelled: dict[str, tuple[Any, dict[str, str]]] = {key: (family, {}) for key, family in self.counters.items()}
        refused = self._family("slora_requests_refused_total", "Requests refused by admission, by reason", counter)
        labelled.update({f"refused_{reason}": (refused, {"reason": reason}) for reason in REFUSAL_REASONS})
        labelled.update(self._step_families(counter))
        labelled.update(self._gc_families(counter))
        self.counters = {key: family.Metric(labels=labels) for key, (family, labels) in labelled.items()}
        finished = self._family("slora_requests_finished_total", "Requests finished, by reason", counter)
        self.finished = {reason: finished.Metric(labels={"reason": reason}) for reason in FINISH_REASONS}
        self.ttft = self._family("slora_time_to_first_token_seconds", "Arrival to first token", histogram).Metric(
            labels={}, buckets=TTFT_BUCKETS
        )
        self.itl = self._family("slora_inter_token_latency_seconds", "Time between two tokens", histogram).Metric(
            labels={}, buckets=ITL_BUCKETS
        )
        self.first_response_delay = self._family(
            "slora_first_response_delay_seconds", "First token's engine output to its response sent", histogram
        ).Metric(labels={}, buckets=DELAY_BUCKETS)
        self.responder_busy_total = self._family(
            "slora_responder_busy_seconds_total", "Time the responder threads spent sending responses", counter
        ).Metric(labels={})
        self._busy_pending = 0.0  # added to the counter with each publication: one message, not one a batch
        self.serving = self._family("slora_engine_serving", "1 while the engine serves, else 0", gauge).Metric(
            labels={}
        )
        self._tenant_families: tuple[Any, ...] = (
            self._family("slora_tenant_requests", "Requests of the busiest tenants by state", gauge),
            self._family("slora_tenant_tokens", "Tokens served to the busiest tenants by kind", gauge),
        )
        self._tenant_metrics: dict[str, tuple[Any, ...]] = {}
        self._tenant_ttft_family = (
            self._family("slora_tenant_time_to_first_token_seconds", "Arrival to first token, by tenant", histogram)
            if tenant_ttft
            else None
        )
        self._tenant_ttft: dict[str, Any] = {}
        self._lora_info = lora_info
        self._lora_family: Any = None
        self._lora_labels: tuple[str, str] | None = None
        self._lora_metric: Any = None
        self._counted: dict[str, float] = {key: 0 for key in self.counters}
        self._stats: EngineStats | None = None
        self._published: EngineStats | None = None
        self._events: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._interval_s = interval_s
        self._thread = threading.Thread(target=self._run, name="slora-metrics", daemon=True)
        self._thread.start()

    def _limit_gauges(self, limits: dict[str, int], gauge: Any) -> dict[str, Any]:
        """slora_engine_limit, set once: the limits never change while the engine serves."""
        unknown = set(limits) - set(ENGINE_LIMITS)
        if unknown:
            raise ValueError(f"unknown engine limits {sorted(unknown)}; known: {', '.join(ENGINE_LIMITS)}")
        family = self._family("slora_engine_limit", "The engine's batch limits as resolved at start", gauge)
        metrics = {}
        for name in ENGINE_LIMITS:
            if limits.get(name, 0) > 0:
                metrics[name] = family.Metric(labels={"limit": name})
                metrics[name].set(limits[name])
        return metrics

    def _step_families(self, counter: Any) -> dict[str, tuple[Any, dict[str, str]]]:
        """The step totals' counters (step_totals.py), by EngineStats field."""
        steps = self._family("slora_steps_total", "Engine steps by kind: decode, or with prompt tokens", counter)
        seconds = self._family(
            "slora_step_seconds_total", "Time of the engine's steps by kind (on CUDA, on the device's stream)", counter
        )
        wall = self._family(
            "slora_step_wall_seconds_total",
            "Host intervals of the engine's steps by kind (beyond their time: the GPU waited)",
            counter,
        )
        copy_wait = self._family(
            "slora_step_copy_wait_seconds_total",
            "Time the device waited ahead of the engine's steps for their adapters' copies, by kind",
            counter,
        )
        requests = self._family("slora_step_requests_total", "Requests the steps ran (batch sizes summed)", counter)
        graphs = self._family("slora_step_graphs_total", "Engine steps replayed as CUDA graphs, by kind", counter)
        out = {}
        for kind in STEP_KINDS:
            out[f"steps_{kind}"] = (steps, {"kind": kind})
            out[f"step_graphs_{kind}"] = (graphs, {"kind": kind})
            out[f"step_seconds_{kind}"] = (seconds, {"kind": kind})
            out[f"step_wall_seconds_{kind}"] = (wall, {"kind": kind})
            out[f"step_copy_wait_seconds_{kind}"] = (copy_wait, {"kind": kind})
            out[f"step_requests_{kind}"] = (requests, {"kind": kind})
        out["step_prompt_tokens"] = (
            self._family("slora_step_prompt_tokens_total", "Prompt tokens the steps computed", counter),
            {},
        )
        return out

    def _gc_families(self, counter: Any) -> dict[str, tuple[Any, dict[str, str]]]:
        """The engine process's garbage collections (backend/runtime/gc_pauses.py), by EngineStats field."""
        seconds = self._family(
            "slora_gc_seconds_total",
            "Time the engine process's garbage collections held the GIL (every thread stopped), by generation",
            counter,
        )
        collections = self._family(
            "slora_gc_collections_total", "The engine process's garbage collections, by generation", counter
        )
        out = {}
        for generation in GC_GENERATIONS:
            out[f"gc_seconds_{generation}"] = (seconds, {"generation": str(generation)})
            out[f"gc_collections_{generation}"] = (collections, {"generation": str(generation)})
        return out

    def _family(self, name: str, description: str, kind: Any) -> Any:
        family = pb_utils.MetricFamily(name=name, description=description, kind=kind)
        self._families.append(family)
        return family

    # ---- called from other threads ----------------------------------------------------------------------------

    def update_stats(self, stats: EngineStats) -> None:
        self._stats = stats  # the newest wins; published by the metrics thread

    def observe(self, kind: str, seconds: float, tenant: str | None = None) -> None:
        self._events.put((kind, seconds))
        if kind == "ttft" and tenant is not None:
            self._events.put(("tenant_ttft", (tenant, seconds)))

    def responder_busy(self, seconds: float) -> None:
        self._events.put(("responder_busy", seconds))

    def count_finished(self, reason: str) -> None:
        self._events.put(("finished", reason))

    def set_serving(self, serving: bool) -> None:
        self._events.put(("serving", serving))

    def replay(self, events: list[tuple[str, Any]]) -> None:
        for kind, value in events:
            if kind in REQUEST_EVENTS:
                self._events.put((kind, value))

    def close(self) -> None:
        self._events.put(None)
        self._thread.join(5.0)
        # Metrics must go before their families.
        self.pages = self.adapters = self.requests = self.counters = self.finished = self.limits = {}
        self.kv_usage = self.ttft = self.itl = self.serving = self._lora_metric = self._lora_family = None
        self.first_response_delay = self.responder_busy_total = None
        self.max_running = self.heavy_max_running = None
        self._tenant_metrics = {}
        self._tenant_ttft = {}
        self._tenant_families = ()
        self._tenant_ttft_family = None
        self._families.clear()

    # ---- the metrics thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            deadline = time.monotonic() + self._interval_s
            while (timeout := deadline - time.monotonic()) > 0:
                try:
                    event = self._events.get(timeout=timeout)
                except queue.Empty:
                    break
                if event is None:
                    return
                self._apply(*event)
            if self._busy_pending > 0:
                self.responder_busy_total.increment(self._busy_pending)
                self._busy_pending = 0.0
            stats = self._stats
            if stats is not None and stats is not self._published:
                try:
                    self._publish(stats)
                except Exception:
                    logger.exception("publishing metrics failed")
                self._published = stats

    def _apply(self, kind: str, value: Any) -> None:
        if kind == "ttft":
            self.ttft.observe(value)
        elif kind == "itl":
            self.itl.observe(value)
        elif kind == "tenant_ttft":
            self._observe_tenant_ttft(*value)
        elif kind == "first_response_delay":
            self.first_response_delay.observe(value)
        elif kind == "responder_busy":
            self._busy_pending += value
        elif kind == "finished" and value in self.finished:
            self.finished[value].increment(1)
        elif kind == "serving":
            self.serving.set(1 if value else 0)

    def _publish(self, stats: EngineStats) -> None:
        # The LoRA label set goes first: a scrape that already shows this step's request counts then shows its
        # adapters too (each gauge's update is its own message, and a router reads them together).
        if self._lora_info:
            self._publish_lora_info(stats)
        self.pages["kv"].set(stats.pages_kv)
        self.pages["adapter"].set(stats.pages_adapter)
        self.pages["free"].set(stats.pages_free)
        self.kv_usage.set(stats.pages_kv / max(stats.pages_total, 1))
        self.adapters["gpu"].set(stats.adapters_gpu)
        self.adapters["host"].set(stats.adapters_host)
        self.adapters["disk"].set(stats.adapters_known)
        self.requests["running"].set(stats.running)
        self.requests["waiting"].set(stats.waiting)
        self.max_running.set(stats.max_running)
        self.heavy_max_running.set(stats.heavy_max_running)
        for key, metric in self.counters.items():
            total = getattr(stats, key)
            if total > self._counted[key]:
                metric.increment(total - self._counted[key])
                self._counted[key] = total
        self._publish_tenants(stats)

    def _publish_tenants(self, stats: EngineStats) -> None:
        """The busiest tenants' gauges. A tenant's series are made when it is first among them and kept (a
        deleted series is a message to the server each time, and the busiest set changes every step), up to
        MAX_TENANT_SERIES tenants in the server's life; tenants beyond that are not exported."""
        for tenant in stats.tenants:
            metrics = self._tenant_series(tenant.tenant)
            if metrics is None:
                continue
            for metric, value in zip(metrics, (tenant.running, tenant.waiting, tenant.prompt_tokens,
                                               tenant.output_tokens)):  # fmt: skip
                metric.set(value)

    def _tenant_series(self, name: str) -> tuple[Any, ...] | None:
        if name not in self._tenant_metrics and len(self._tenant_metrics) < MAX_TENANT_SERIES:
            requests, tokens = self._tenant_families
            self._tenant_metrics[name] = (
                requests.Metric(labels={"tenant": name, "state": "running"}),
                requests.Metric(labels={"tenant": name, "state": "waiting"}),
                tokens.Metric(labels={"tenant": name, "kind": "prompt"}),
                tokens.Metric(labels={"tenant": name, "kind": "output"}),
            )
        return self._tenant_metrics.get(name)

    def _observe_tenant_ttft(self, tenant: str, seconds: float) -> None:
        """Into the tenant's histogram, made at its first token (MAX_TENANT_SERIES tenants in the server's life)."""
        histogram = self._tenant_ttft.get(tenant)
        if histogram is None and self._tenant_ttft_family is not None and len(self._tenant_ttft) < MAX_TENANT_SERIES:
            histogram = self._tenant_ttft_family.Metric(labels={"tenant": tenant}, buckets=TTFT_BUCKETS)
            self._tenant_ttft[tenant] = histogram
        if histogram is not None:
            histogram.observe(seconds)

    def _publish_lora_info(self, stats: EngineStats) -> None:
        labels = (",".join(stats.running_adapters), ",".join(stats.waiting_adapters))
        if labels != self._lora_labels:
            self._replace_lora_series(labels)  # stamped there, before the old series goes
        else:
            self._lora_metric.set(time.time())

    def _replace_lora_series(self, labels: tuple[str, str]) -> None:
        """The LoRA gauge's family anew with one series for `labels`, made before the old family and its series
        go, so that a scrape between the two sees both (the newer stamp wins, as with vLLM's gauge), never none."""
        old = self._lora_family
        self._lora_family = self._family(
            LORA_INFO_METRIC, "Running and waiting LoRA adapters", pb_utils.MetricFamily.GAUGE
        )
        self._lora_metric = self._lora_family.Metric(
            labels={
                "running_lora_adapters": labels[0],
                "waiting_lora_adapters": labels[1],
                "max_lora": str(self._max_lora),
            }
        )
        self._lora_metric.set(time.time())
        self._lora_labels = labels
        if old is not None:
            self._families.remove(old)  # the last reference to the old family and, through it, its series
