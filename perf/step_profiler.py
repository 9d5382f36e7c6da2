"""Profile a few engine steps in the middle of a run: where the time of a step goes, by operator.

torch.profiler records steps [start, start + count) of the replay; the table of operators sorted by device time
(CPU time without CUDA) is logged and written to a text file, so that a missed target can say where time goes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


class StepProfiler:
    def __init__(self, start: int, count: int, out_file: Path | None, title: str = "") -> None:
        if start < 0 or count < 0:
            raise ValueError(f"profile start and count must be >= 0, got {start}, {count}")
        self.start = start
        self.count = count
        self.out_file = out_file
        self.title = title
        self._step = 0
        self._profiler: Any = None
        self.table: str | None = None

    def before_step(self) -> None:
        if self.count and self._step == self.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()

    def after_step(self) -> None:
        self._step += 1
        if self._profiler is not None and self._step == self.start + self.count:
            self.finish()

    def finish(self) -> None:
        """Stop early (the run ended before `count` steps were profiled) and report what was recorded."""
        if self._profiler is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._profiler.__exit__(None, None, None)
        sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        self.table = self._profiler.key_averages().table(sort_by=sort_by, row_limit=30)
        self._profiler = None
        header = f"profile of {self._step - self.start} step(s) from step {self.start} {self.title}"
        logger.info("%s\n%s", header, self.table)
        if self.out_file is not None:
            self.out_file.parent.mkdir(parents=True, exist_ok=True)
            with self.out_file.open("a") as f:
                f.write(f"== {header}\n{self.table}\n")
