"""Adapter copies into the page pool on a thread of their own, so that they overlap the engine's steps.

The engine thread only decides where an adapter goes (its pages) and gets a Future back; this thread does the
copy. On CUDA a host image in pageable memory is first copied (by the CPU) into one of a few page-locked staging
buffers, then to the GPU on a side stream; the Future's result is the CUDA event recorded after that copy, which
the runner makes the compute stream wait for before the first batch that reads the adapter. A staging buffer is
reused only after the GPU copy out of it has finished. On CPU the copy is done when the Future is.

Evicting an adapter whose copy has not been issued withdraws the copy (`withdraw`): the pages it was to write can be
reused at once, and the engine thread never waits for a staging, which itself waits for the GPU copy two turns back.

Before, the CPU copy into the (single) staging buffer ran on the engine thread: ~2 ms for a 7B rank-8 adapter
(16.8 MB) and four times that for S2's average one, times the adapters a step loads, added to the step.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

CopyDone = Future  # result: the torch.cuda.Event after the copy on CUDA, None on CPU
STAGING_BUFFERS = 2  # a CPU copy into one overlaps the GPU copy out of the other


@dataclass
class _CopyState:
    issued: bool = False  # the copy into the pool is issued (on CPU: written): it can no longer be withdrawn
    withdrawn: bool = False  # its pages were freed first: it must write nothing


class AdapterCopier:
    def __init__(self, storage: torch.Tensor, staging_buffers: int = STAGING_BUFFERS) -> None:
        self._storage = storage  # the pool: [num_layers, num_pages, page_elems]
        self._stream = torch.cuda.Stream(storage.device) if storage.is_cuda else None
        self._staging: list[torch.Tensor | None] = [None] * staging_buffers  # page-locked, flat
        self._staged: list[torch.cuda.Event | None] = [None] * staging_buffers  # the GPU copy out of each
        self._turn = 0
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slora-adapter-copy")
        self._issue = threading.Lock()  # held while a copy is issued (on CPU: written)
        self._states: dict[CopyDone, _CopyState] = {}  # the copies not done yet

    def submit(self, image: torch.Tensor, page_index: torch.Tensor) -> CopyDone:
        """Copy `image` ([num_layers, len(pages), page_elems], host) into the pages of every layer that
        `page_index` (int64, host) names, once the work already queued on the compute stream is done: with
        overlapped steps a launched step may still read those pages (they were freed after it was launched)."""
        after = None
        if self._stream is not None:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self._storage.device))
        state = _CopyState()
        copy = self._thread.submit(self._copy, image, page_index, after, state)
        self._states[copy] = state
        copy.add_done_callback(self._forget)
        return copy

    def withdraw(self, copy: CopyDone) -> bool:
        """Make sure `copy` writes nothing into the pool from now on, if it has not started writing: True when it
        never will (its pages may be reused at once), False when it has (its Future's result is, or is about to be,
        the event after it). Never waits for the staging, which may stand behind the GPU copies before it; only, on
        CPU, for a write in progress."""
        if copy.cancel():
            return True
        state = self._states.get(copy)
        if state is None:
            return False
        with self._issue:
            if state.issued:
                return False
            state.withdrawn = True
            return True

    def close(self) -> None:
        self._thread.shutdown(wait=True)

    def _forget(self, copy: CopyDone) -> None:
        self._states.pop(copy, None)

    def _copy(
        self, image: torch.Tensor, page_index: torch.Tensor, after: torch.cuda.Event | None, state: _CopyState
    ) -> torch.cuda.Event | None:
        source = image if self._stream is None or image.is_pinned() else self._stage(image)
        with self._issue:  # withdraw() decides under this lock: either this copy writes or it is withdrawn
            if state.withdrawn:
                return None
            state.issued = True
            if self._stream is None:
                copy_pages_on_host(self._storage, page_index, image)
                return None
            assert after is not None
            self._stream.wait_event(after)
            with torch.cuda.stream(self._stream):
                on_device = source.to(self._storage.device, non_blocking=True)
                self._storage.index_copy_(1, page_index.to(self._storage.device, non_blocking=True), on_device)
                done = torch.cuda.Event()
                done.record(self._stream)
        if source is not image:
            self._staged[self._turn] = done
            self._turn = (self._turn + 1) % len(self._staging)
        return done

    def _stage(self, image: torch.Tensor) -> torch.Tensor:
        """`image` copied into this turn's page-locked buffer, once the GPU copy out of it has finished."""
        previous = self._staged[self._turn]
        if previous is not None:
            previous.synchronize()
        buffer = self._staging[self._turn]
        if buffer is None or buffer.numel() < image.numel() or buffer.dtype != image.dtype:
            buffer = torch.empty(image.numel(), dtype=image.dtype, pin_memory=True)
            self._staging[self._turn] = buffer
        staged = buffer[: image.numel()].view(image.shape)
        staged.copy_(image)
        return staged


_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_pages_on_host(storage: torch.Tensor, page_index: torch.Tensor, image: torch.Tensor) -> None:
    """storage[:, page_index] = image for a pool in host memory, through numpy (integer views of the same width:
    numpy has no bfloat16), so that this thread runs no torch CPU op.

    A torch op that goes parallel (a large copy, any GEMM) on a second thread starts an OpenMP thread team of its
    own. With more OpenMP threads than cores, libgomp throttles its threads' spin-waiting for good, and the engine
    thread's small CPU GEMMs then ran 2.5-4x slower (19 us -> 50-75 us for 128x64 by 64x256 on the 2-core CI
    machine, from the first adapter copy on; perf/RESULTS.md).
    """
    if image.dtype != storage.dtype:  # the integer views below would reinterpret the bits
        raise ValueError(f"adapter image is {image.dtype}, the pool {storage.dtype}")
    as_int = _SAME_WIDTH_INT[storage.element_size()]
    storage.view(as_int).numpy()[:, page_index.numpy()] = image.view(as_int).numpy()
