"""What the engine's steps did since it started, by kind: a decode step computes one token of each running request;
a prompt step also computes prompt tokens (whole prompts or chunks). Exported as counters
(`slora_steps_total`, `slora_step_seconds_total`, ... on Triton's metrics port), so that a scraper can take any window's
mean step time, batch and prompt tokens per step by the difference of two scrapes: where a first token's time goes
under load (a step that computes prompts takes as long as its prompt tokens make it, and every request in it waits
for it) without a profiler on the server.

A step's time is the step clock's (step_clock.py): on CUDA its own time on the device's stream, elsewhere the time
between its tokens and the previous step's. Steps replayed as CUDA graphs are counted apart as well: a step with
prompts beyond the graphs' tokens (mixed_cuda_graph_tokens) is launched kernel by kernel, which on a fast GPU takes
longer than running it.

Each kind also sums its steps' wall time (Step.interval_s: from the previous step's tokens to its own, on the host;
after a pause, from its own plan). Over a window, all steps' wall time beyond their time on the device is time the
GPU waited for the host between steps (launches, planning, copies it had to wait for); the window's time beyond the
wall time is pauses, when the engine had nothing to run. One kind's difference alone means little: the host launches
a step before it reads the previous one's tokens, so an eager step's launches lengthen the previous step's interval
and shorten its own. Of that waiting, the part the device's stream stood still ahead of a step for the copies of its
new adapters is summed apart (copy_wait_seconds, CUDA only): time no faster host would win back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slora.backend.engine.step_clock import Step

KINDS = ("decode", "prompt")


@dataclass
class KindTotals:
    steps: int = 0
    seconds: float = 0.0
    requests: int = 0  # the steps' batch sizes, summed
    graphs: int = 0  # of the steps, those replayed as CUDA graphs
    wall_seconds: float = 0.0  # the steps' host intervals (Step.interval_s), summed
    copy_wait_seconds: float = 0.0  # the device's stream waiting ahead of the steps for their adapters' copies


@dataclass
class StepTotals:
    kinds: dict[str, KindTotals] = field(default_factory=lambda: {kind: KindTotals() for kind in KINDS})
    prompt_tokens: int = 0

    def add(self, step: Step, graph: bool = False, copy_wait_s: float = 0.0) -> None:
        totals = self.kinds["prompt" if step.prompt_tokens else "decode"]
        totals.steps += 1
        totals.graphs += graph
        totals.seconds += step.seconds
        totals.wall_seconds += step.interval_s
        totals.copy_wait_seconds += copy_wait_s
        totals.requests += step.seqs
        self.prompt_tokens += step.prompt_tokens

    def as_stats(self) -> dict[str, int | float]:
        """The totals as EngineStats fields: steps_<kind>, step_seconds_<kind>, step_wall_seconds_<kind>,
        step_copy_wait_seconds_<kind>, step_requests_<kind>, step_graphs_<kind>, step_prompt_tokens."""
        out: dict[str, int | float] = {"step_prompt_tokens": self.prompt_tokens}
        for kind, totals in self.kinds.items():
            out.update({f"steps_{kind}": totals.steps, f"step_seconds_{kind}": totals.seconds,
                        f"step_wall_seconds_{kind}": totals.wall_seconds,
                        f"step_copy_wait_seconds_{kind}": totals.copy_wait_seconds,
                        f"step_requests_{kind}": totals.requests,
                        f"step_graphs_{kind}": totals.graphs})  # fmt: skip
        return out
