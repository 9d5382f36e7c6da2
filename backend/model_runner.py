"""One forward over a scheduled batch, then sampling. Knows nothing of queues or requests' life."""

from __future__ import annotations

from collections.abc import Callable

import torch

from slora.backend.batch import ForwardBatch, ScheduledSeq, build_batch
from slora.backend.cuda_graphs import DecodeGraphs
from slora.backend.model import DecoderModel
from slora.backend.page_pool import PagePool
from slora.backend.request import Request
from slora.backend.sampler import sample


class ModelRunner:
    def __init__(self, model: DecoderModel, pool: PagePool, graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.pool = pool
        self.graphs = graphs  # decode steps replay captured CUDA graphs when set
        self.device = pool.storage.device
        self.logits_hook: Callable[[torch.Tensor], None] | None = None  # tests read the logits of each step

    def run(self, seqs: list[ScheduledSeq]) -> list[tuple[Request, int]]:
        """Compute the scheduled tokens; return (request, next token) for each sequence that samples."""
        batch = build_batch(seqs, self.pool.geometry.block_size, self.device)
        self._wait_for_adapters(batch)
        if self.graphs is not None and self.graphs.fits(batch):
            logits = self.graphs.forward(batch)  # [num_sampled, vocab]: every decode sequence samples
        else:
            logits = self.model.forward(batch, self.pool)  # [num_sampled, vocab]
        if self.logits_hook is not None:
            self.logits_hook(logits)
        sampled = batch.sampled
        tokens = sample(logits, [s.request.sampling for s in sampled], [s.request.generator for s in sampled])
        return [(s.request, token) for s, token in zip(sampled, tokens)]

    def _wait_for_adapters(self, batch: ForwardBatch) -> None:
        # Adapter copies run on a side stream; the forward must not read pages still being filled.
        if not self.device.type == "cuda":
            return
        stream = torch.cuda.current_stream(self.device)
        for s in batch.seqs:
            resident = s.request.resident
            if resident is not None and resident.ready is not None:
                stream.wait_event(resident.ready)
