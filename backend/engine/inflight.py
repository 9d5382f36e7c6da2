"""A launched step whose sampled tokens are still on the device (overlapped steps, engine.py).

With overlap, the engine launches step N + 1 before it reads step N's tokens back, so that the host builds and
launches the next step while the GPU still runs the last one (vLLM's async scheduling does the same). A request
whose token is in flight counts it in `Request.num_inflight`; the next step's batch takes that token as its input
on the device: as the whole input of a decode step built from the previous one (decode_batch.py), or row by row
(`patch_inputs`) for any other batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from slora.backend.engine.request import Request
from slora.backend.executor.batch import ForwardBatch, list_to_device


@dataclass
class InflightStep:
    batch: ForwardBatch
    tokens: torch.Tensor  # int64 [num_sampled], on the device: one per batch.sampled
    requests: list[Request]  # batch.sampled's requests, in that order
    index: dict[int, int] = field(default_factory=dict)  # id(request) -> its position in `tokens`, built lazily
    began: torch.cuda.Event | None = None  # CUDA: recorded (with timing) ahead of the step's forward
    host_tokens: torch.Tensor | None = None  # CUDA: page-locked copy of `tokens`, complete once `copied` is
    copied: torch.cuda.Event | None = None
    device_s: float | None = None  # after read(), with `began`: the step's own time on the device's stream
    graph: bool = False  # replayed as a CUDA graph (decode or with prompts), not launched kernel by kernel
    stalled: torch.cuda.Event | None = None  # CUDA: recorded ahead of the waits for adapter copies, when it had any
    copy_wait_s: float = 0.0  # after read(), with `stalled`: how long the device's stream waited for those copies

    def __post_init__(self) -> None:
        # Reading `tokens` itself would queue its copy behind everything launched since (the next step): the copy
        # to the host is queued now, right behind the sampling, and read() waits for it alone.
        if self.tokens.is_cuda:
            self.host_tokens = torch.empty(self.tokens.shape, dtype=self.tokens.dtype, pin_memory=True)
            self.host_tokens.copy_(self.tokens, non_blocking=True)
            self.copied = torch.cuda.Event(enable_timing=self.began is not None)
            self.copied.record()

    def position(self, request: Request) -> int:
        if not self.index:
            self.index = {id(r): i for i, r in enumerate(self.requests)}
        return self.index[id(request)]

    def read(self) -> list[tuple[Request, int]]:
        """(request, token) for each sampled sequence; waits for the device. The tokens leave flight."""
        if self.copied is not None and self.host_tokens is not None:
            self.copied.synchronize()
            values = self.host_tokens.tolist()
            if self.began is not None:
                self.device_s = self.began.elapsed_time(self.copied) / 1000.0
                if self.stalled is not None:
                    self.copy_wait_s = self.stalled.elapsed_time(self.began) / 1000.0
        else:
            values = self.tokens.tolist()
        for request in self.requests:
            request.num_inflight -= 1
        return list(zip(self.requests, values))


def patch_inputs(batch: ForwardBatch, previous: InflightStep | None) -> None:
    """Write into `batch.input_ids` the tokens of its rows whose input is still in flight in `previous`."""
    if previous is None or batch.input_ids is previous.tokens:
        return
    rows: list[int] = []
    sources: list[int] = []
    starts = batch.attn.q_start_host
    for i, s in enumerate(batch.seqs):
        r = s.request
        if r.num_inflight and r.num_computed >= len(r.token_ids):  # its first token this step is not on the host
            rows.append(starts[i])
            sources.append(previous.position(r))
    if rows:
        device = batch.input_ids.device
        index = list_to_device(sources, torch.int64, device)
        batch.input_ids[list_to_device(rows, torch.int64, device)] = previous.tokens[index]
