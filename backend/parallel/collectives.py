"""The collectives of one tensor-parallel group: all-reduce, all-gather, gather to rank 0, broadcast from rank 0.

A group is a torch.distributed backend object of its own (gloo on the CPU, NCCL on GPUs), not the process-wide
default group: an engine's group lives and dies with the engine, and several engines may be built one after the
other in one process (tests). Ranks meet through a TCPStore that rank 0 serves on a free port.

NVLink multicast (NVLS) stays off on GPU hosts (NCCL_NVLS_ENABLE=0) unless the environment says otherwise: the
hosts this project runs on hang or fail with it.
"""

from __future__ import annotations

import os
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

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        """Sum `tensor` (contiguous) over the ranks, in place."""
        if self.size == 1 or tensor.numel() == 0:
            return
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp(op)
        self.backend.allreduce([_contiguous(tensor)], options).wait()

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[size, *tensor.shape]: every rank's `tensor`, in rank order (into `out` when given)."""
        out = out if out is not None else tensor.new_empty((self.size, *tensor.shape))
        if tensor.numel():
            self.backend.allgather([list(out.unbind(0))], [_contiguous(tensor)]).wait()
        return out

    def gather(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """On rank 0, [size, *tensor.shape] of every rank's `tensor`; None on the others."""
        options = dist.GatherOptions()
        options.rootRank = 0
        out = tensor.new_empty((self.size, *tensor.shape)) if self.rank == 0 else None
        outputs = [list(out.unbind(0))] if out is not None else []
        self.backend.gather(outputs, [_contiguous(tensor)], options).wait()
        return out

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every rank's (same shape and dtype), in place."""
        if self.size == 1 or tensor.numel() == 0:
            return
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        self.backend.broadcast([_contiguous(tensor)], options).wait()

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (the page count every rank's pool can hold)."""
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.all_reduce(tensor, dist.ReduceOp.MIN)
        return int(tensor.item())

    def abort(self) -> None:
        """Make collectives blocked on a dead rank fail instead of waiting (best effort: not every backend can)."""
        try:
            self.backend.abort()
        except Exception:  # noqa: BLE001 (the group is being given up on either way)
            pass


def serve_store(size: int, timeout: timedelta = CONNECT_TIMEOUT) -> dist.TCPStore:
    """Rank 0's rendezvous store, on a free port of this host (its `.port`)."""
    return dist.TCPStore(STORE_HOST, 0, size, True, timeout=timeout, wait_for_workers=False)


def join_store(port: int, size: int, timeout: timedelta = CONNECT_TIMEOUT) -> dist.TCPStore:
    return dist.TCPStore(STORE_HOST, port, size, False, timeout=timeout)


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(f"collectives need contiguous tensors, got strides {tensor.stride()}")
    return tensor
