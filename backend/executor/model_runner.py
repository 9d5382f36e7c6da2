"""One forward over a scheduled batch, then sampling. Knows nothing of queues or requests' life."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from slora.backend.engine.inflight import InflightStep, patch_inputs
from slora.backend.engine.request import Request
from slora.backend.executor.batch import ForwardBatch, ScheduledSeq
from slora.backend.executor.cuda_graphs import DecodeGraphs
from slora.backend.executor.decode_batch import DecodeBatches
from slora.backend.executor.lora_tables import LoraTablesCache
from slora.backend.executor.mixed_graphs import MixedGraphs
from slora.backend.executor.sampler import sample_on_device
from slora.backend.memory.page_pool import PagePool
from slora.backend.model.decoder import DecoderModel

PHASES = ("build", "wait", "launch", "sample")


@dataclass(frozen=True)
class StepShape:
    # "graph" (a replayed decode graph), "mixed_graph" (a replayed graph of a step with prompts), "decode" (eager,
    # one token per sequence) or "mixed" (eager, with prompts)
    kind: str
    num_seqs: int
    num_tokens: int
    # Host seconds of each PHASE: building the batch, waiting for adapter copies, launching the forward and the
    # sampling (eager: every kernel launch; the GPU runs behind), reading sampled tokens back (which waits for the
    # GPU: for this step's, or with overlapped steps for the previous step's, read after this one is launched).
    phases: tuple[float, ...] = (0.0,) * len(PHASES)


def step_kind(batch: ForwardBatch, graph: bool) -> str:
    decode = batch.num_tokens == len(batch.seqs)
    if graph:
        return "graph" if decode else "mixed_graph"
    return "decode" if decode else "mixed"


def _device_clock(device: torch.device) -> torch.cuda.Event | None:
    """On CUDA, an event recorded now on the current stream: from it to the step's tokens is the step's own time
    on the device, whatever the host did meanwhile (with overlapped steps its tokens are read after the next step
    is launched, and a timer on the host would give this step the next one's launch)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        pool: PagePool,
        graphs: DecodeGraphs | None = None,
        mixed_graphs: MixedGraphs | None = None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.graphs = graphs  # decode steps replay captured CUDA graphs when set
        self.mixed_graphs = mixed_graphs  # and steps with prompts theirs
        self.device = pool.storage.device
        self.logits_hook: Callable[[torch.Tensor], None] | None = None  # tests read the logits of each step
        self.lora_tables = LoraTablesCache()  # the adapters' tables, kept while a step's adapters stay the same
        # a decode step's batch from the previous one's when both run the same requests (decode_batch.py)
        self.batches = DecodeBatches(pool.geometry.block_size, self.device, self.lora_tables)
        self.last_step = StepShape("none", 0, 0)  # what the latest forward was (benchmarks tally step kinds)

    def run(self, seqs: list[ScheduledSeq]) -> list[tuple[Request, int]]:
        """Compute the scheduled tokens; return (request, next token) for each sequence that samples."""
        return self.collect(self.launch(seqs))

    def launch(self, seqs: list[ScheduledSeq], previous: InflightStep | None = None) -> InflightStep:
        """Build the batch, launch the forward and the sampling, and return without waiting for the device.

        `previous`: the step launched before, if its tokens are still in flight: this step's inputs that are
        among them are taken from the device (inflight.py)."""
        began = time.perf_counter()
        batch = self.batches.build(seqs, previous.tokens if previous is not None else None)
        patch_inputs(batch, previous)
        built = time.perf_counter()
        stalled = self._wait_for_adapters(batch)
        waited = time.perf_counter()
        on_device = _device_clock(self.device)
        graph = True
        if self.graphs is not None and self.graphs.fits(batch):
            logits = self.graphs.forward(batch)  # [num_sampled, vocab]: every decode sequence samples
        elif self.mixed_graphs is not None and self.mixed_graphs.fits(batch):
            logits = self.mixed_graphs.forward(batch)  # [num_sampled, vocab]
        else:
            graph = False
            logits = self.model.forward(batch, self.pool)  # [num_sampled, vocab]
        if self.logits_hook is not None:
            self.logits_hook(logits)
        sampled = batch.sampled
        requests = [s.request for s in sampled]
        tokens = sample_on_device(logits, [r.sampling for r in requests], [r.generator for r in requests])
        for request in requests:
            request.num_inflight += 1
        launched = time.perf_counter()
        phases = (built - began, waited - built, launched - waited, 0.0)
        self.last_step = StepShape(step_kind(batch, graph), len(batch.seqs), batch.num_tokens, phases)
        return InflightStep(batch, tokens, requests, began=on_device, graph=graph, stalled=stalled)

    def collect(self, step: InflightStep) -> list[tuple[Request, int]]:
        """Wait for a launched step's tokens: (request, token) for each sequence that sampled. The time spent
        waiting is the `sample` phase of the latest launched step's shape."""
        began = time.perf_counter()
        sampled = step.read()
        shape = self.last_step
        phases = (*shape.phases[:-1], shape.phases[-1] + time.perf_counter() - began)
        self.last_step = StepShape(shape.kind, shape.num_seqs, shape.num_tokens, phases)
        return sampled

    def _wait_for_adapters(self, batch: ForwardBatch) -> torch.cuda.Event | None:
        """Make the step follow the copies of its adapters that no earlier step waited for. Adapter copies run on
        the copier's thread (and a side stream): the forward must not read pages still being filled. Each adapter is
        waited for once: later work on the compute stream follows the copy.

        On CUDA, when there was a copy to wait for: an event recorded ahead of the waits, so that from it to the
        step's own start event is the time the device's stream stood still for the copies (InflightStep.copy_wait_s),
        which the step's time leaves out and the gap between steps would otherwise show as the GPU waiting for the
        host."""
        pending = [s.request.resident for s in batch.seqs if s.request.resident is not None]
        pending = [resident for resident in pending if resident.ready is not None]
        if not pending:
            return None
        stalled = _device_clock(self.device)
        for resident in pending:
            resident.wait_copied(self.device)
        return stalled
