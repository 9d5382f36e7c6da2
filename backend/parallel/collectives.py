"""The collectives of one tensor-parallel group: all-reduce, all-gather, gather to rank 0, broadcast from rank 0.

A group is a torch.distributed backend object of its own (gloo on the CPU, NCCL on GPUs), not the process-wide
default group: an engine's group lives and dies with the engine, and several engines may be built one after the
other in one process (tests). Ranks meet through a TCPStore that rank 0 serves on a free port.

NVLink multicast (NVLS) stays off on GPU hosts (NCCL_NVLS_ENABLE=0) unless the environment says otherwise: the
hosts this project runs on hang or fail with it.
"""

from __future__ import annotations

import os
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

CONNECT_TIMEOUT = timedelta(minutes=5)  # ranks joining the group (processes starting, importing torch)
STORE_HOST = "127.0.0.1"  # one host: the ranks are the engine process and its worker processes


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class Collectives:
    """Synchronous collectives for the caller (on CUDA: ordered on the current stream, the host does not wait).

    Every rank must call the same collectives in the same order with tensors of the same shapes: the ranks run
    the same forward over the same step plan (decoder.py), which keeps that so.
    """

    def __init__(self, backend: Any, rank: int, size: int, device: torch.device) -> None:
        self.backend = backend  # a c10d ProcessGroupGloo or ProcessGroupNCCL (typed loosely: torch's stubs lack them)
        self.rank = rank
        self.size = size
        self.device = device
        self.timer: CollectiveTimer | None = None  # set to measure the collectives by label (perf/profile_tp_step.py)

    def _timed(self, label: str) -> AbstractContextManager[None]:
        return self.timer.measure(label) if self.timer is not None else nullcontext()

    @classmethod
    def connect(
        cls, store: dist.Store, rank: int, size: int, device: torch.device, timeout: timedelta = CONNECT_TIMEOUT
    ) -> Collectives:
        """Join the group of `size` ranks meeting at `store` (blocks until all have joined)."""
        prefixed = dist.PrefixStore("slora-tp", store)
        if backend_for(device) == "nccl":
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            backend: Any = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        else:
            backend = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        return cls(backend, rank, size, device)

    def all_reduce(
        self, tensor: torch.Tensor, label: str = "other", op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> None:
        """Sum `tensor` (contiguous) over the ranks, in place. `label`: what the timer counts it as."""
        if self.size == 1 or tensor.numel() == 0:
            return
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp(op)
        with self._timed(label):
            self.backend.allreduce([_contiguous(tensor)], options).wait()

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor | None = None, label: str = "other") -> torch.Tensor:
        """[size, *tensor.shape]: every rank's `tensor`, in rank order (into `out` when given)."""
        out = out if out is not None else tensor.new_empty((self.size, *tensor.shape))
        if tensor.numel():
            with self._timed(label):
                self.backend.allgather([list(out.unbind(0))], [_contiguous(tensor)]).wait()
        return out

    def gather(self, tensor: torch.Tensor, label: str = "other") -> torch.Tensor | None:
        """On rank 0, [size, *tensor.shape] of every rank's `tensor`; None on the others."""
        options = dist.GatherOptions()
        options.rootRank = 0
        out = tensor.new_empty((self.size, *tensor.shape)) if self.rank == 0 else None
        outputs = [list(out.unbind(0))] if out is not None else []
        with self._timed(label):
            self.backend.gather(outputs, [_contiguous(tensor)], options).wait()
        return out

    def broadcast(self, tensor: torch.Tensor, label: str = "other") -> None:
        """Rank 0's `tensor` into every rank's (same shape and dtype), in place."""
        if self.size == 1 or tensor.numel() == 0:
            return
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        with self._timed(label):
            self.backend.broadcast([_contiguous(tensor)], options).wait()

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (the page count every rank's pool can hold)."""
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def abort(self) -> None:
        """Make collectives blocked on a dead rank fail instead of waiting (best effort: not every backend can)."""
        try:
            self.backend.abort()
        except Exception:  # noqa: BLE001 (the group is being given up on either way)
            pass


class CollectiveTimer:
    """Time spent in the collectives of each label, and how many ran: on CUDA between events on the current
    stream around each one (its launch, the wait for the slowest rank, the transfer), on the CPU on the clock."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self._pending: list[tuple[str, Any, Any]] = []  # CUDA events not read yet

    @contextmanager
    def measure(self, label: str) -> Iterator[None]:
        self.calls[label] += 1
        if self.device.type != "cuda":
            began = time.perf_counter()
            yield
            self.seconds[label] += time.perf_counter() - began
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._pending.append((label, start, end))

    def add(self, label: str, seconds: float) -> None:
        """Count host time measured elsewhere (the step plan rank 0 sends) under `label`."""
        self.calls[label] += 1
        self.seconds[label] += seconds

    def read(self) -> dict[str, float]:
        """Seconds per label so far (waits for the device on CUDA)."""
        if self._pending:
            torch.cuda.synchronize(self.device)
            for label, start, end in self._pending:
                self.seconds[label] += start.elapsed_time(end) / 1000.0
            self._pending = []
        return dict(self.seconds)


def serve_store(size: int, timeout: timedelta = CONNECT_TIMEOUT) -> dist.TCPStore:
    """Rank 0's rendezvous store, on a free port of this host (its `.port`)."""
    return dist.TCPStore(STORE_HOST, 0, size, True, timeout=timeout, wait_for_workers=False)


def join_store(port: int, size: int, timeout: timedelta = CONNECT_TIMEOUT) -> dist.TCPStore:
    return dist.TCPStore(STORE_HOST, port, size, False, timeout=timeout)


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(f"collectives need contiguous tensors, got strides {tensor.stride()}")
    return tensor
