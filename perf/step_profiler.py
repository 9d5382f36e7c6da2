"""Where the time of an engine step goes: device kernels (torch.profiler) and host Python (cProfile).

Two windows of `count` steps each, one after the other from step `start`, so that neither profiler slows the
other's window: first torch.profiler (table of operators by device time, and how much of the wall time the
device was busy: the rest is host overhead: scheduling, batch building, sampling, detokenizing), then cProfile
(host functions by cumulative time). Both are logged and appended to a text file. The torch window also gets a
timeline of each step (perf/trace_steps.py: device span, busy and idle time against the host's), from the
profiler's chrome trace, which `trace_file` keeps (gzipped) when given.
"""

from __future__ import annotations

import cProfile
import gzip
import io
import logging
import pstats
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from perf.trace_steps import STEP_ANNOTATION, load_trace, step_timelines, summary

logger = logging.getLogger(__name__)


class StepProfiler:
    def __init__(
        self, start: int, count: int, out_file: Path | None, title: str = "", trace_file: Path | None = None
    ) -> None:
        if start < 0 or count < 0:
            raise ValueError(f"profile start and count must be >= 0, got {start}, {count}")
        self.start = start
        self.count = count
        self.out_file = out_file
        self.title = title
        self.trace_file = trace_file
        self._annotation: Any = None  # the step's slora_step range while torch.profiler records
        self._step = 0
        self._torch: Any = None
        self._python: cProfile.Profile | None = None
        self._began = 0.0
        self.reports: list[str] = []

    @property
    def total_steps(self) -> int:
        return self.start + 2 * self.count

    def before_step(self) -> None:
        if not self.count:
            return
        if self._step == self.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._torch = torch.profiler.profile(activities=activities)
            self._torch.__enter__()
            self._began = time.perf_counter()
        if self._torch is not None:
            self._annotation = torch.profiler.record_function(STEP_ANNOTATION)
            self._annotation.__enter__()
        elif self._step == self.start + self.count:
            self._python = cProfile.Profile()
            self._python.enable()

    def after_step(self) -> None:
        if self._annotation is not None:
            self._annotation.__exit__(None, None, None)
            self._annotation = None
        self._step += 1
        if self._torch is not None and self._step == self.start + self.count:
            self._finish_torch()
        elif self._python is not None and self._step == self.start + 2 * self.count:
            self._finish_python()

    def finish(self) -> None:
        """Stop whatever is still recording (the run ended early) and report it."""
        if self._annotation is not None:
            self._annotation.__exit__(None, None, None)
            self._annotation = None
        if self._torch is not None:
            self._finish_torch()
        if self._python is not None:
            self._finish_python()

    def _finish_torch(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - self._began) * 1e6
        self._torch.__exit__(None, None, None)
        averages = self._torch.key_averages()
        timeline = self._timeline(self._torch)
        self._torch = None
        on_device = torch.cuda.is_available()
        sort_by = "self_cuda_time_total" if on_device else "self_cpu_time_total"
        busy_us = sum(_device_time(event) for event in averages) if on_device else 0.0
        steps = max(self._step - self.start, 1)
        busy_share = 100 * busy_us / max(wall_us, 1.0)
        overall = (f"{steps} step(s): {wall_us / 1e3 / steps:.2f} ms wall per step, device busy "
                   f"{busy_us / 1e3 / steps:.2f} ms per step ({busy_share:.0f}%)")  # fmt: skip
        self._report(f"torch.profiler {overall}", averages.table(sort_by=sort_by, row_limit=30))
        self._report(f"steps' timelines, torch.profiler window of {steps} step(s)", timeline)

    def _timeline(self, profile: Any) -> str:
        """perf/trace_steps.py's table of the window's steps; the chrome trace kept in trace_file if given."""
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            profile.export_chrome_trace(str(path))
            table = summary(step_timelines(load_trace(path)))
            if self.trace_file is not None:
                self.trace_file.parent.mkdir(parents=True, exist_ok=True)
                with path.open("rb") as src, gzip.open(self.trace_file, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        return table

    def _finish_python(self) -> None:
        assert self._python is not None
        self._python.disable()
        text = io.StringIO()
        pstats.Stats(self._python, stream=text).sort_stats("cumulative").print_stats(35)
        self._python = None
        self._report(f"cProfile of {self.count} step(s) (host time, slowed by cProfile itself)", text.getvalue())

    def _report(self, header: str, table: str) -> None:
        header = f"{header} {self.title}".strip()
        self.reports.append(header)
        logger.info("%s\n%s", header, table)
        if self.out_file is not None:
            self.out_file.parent.mkdir(parents=True, exist_ok=True)
            with self.out_file.open("a") as f:
                f.write(f"== {header}\n{table}\n")


def _device_time(event: Any) -> float:
    """Kernel time of a device event (as torch's own table footer sums it); 0 for host events."""
    from torch.autograd import DeviceType

    if getattr(event, "device_type", DeviceType.CPU) == DeviceType.CPU:
        return 0.0
    return float(getattr(event, "self_device_time_total", 0.0) or 0.0)
