"""The engine's step totals (step_totals.py, EngineStats.steps_*): what its steps computed adds up to what its
requests asked for, counted from the requests themselves."""

from __future__ import annotations

import random

import pytest

from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.outputs import STATS_COUNTERS
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.engine.step_clock import Step
from slora.backend.engine.step_totals import StepTotals
from tests.model_fixtures import ModelWithAdapters


def test_the_steps_add_up_to_the_requests_prompts_and_tokens(llama: ModelWithAdapters, target: dict[str, str]) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 100) for _ in range(rng.randint(3, 30))] for _ in range(9)]
    adapters = [rng.choice([None, *llama.adapters]) for _ in prompts]
    lengths = [rng.randint(1, 12) for _ in prompts]
    config = EngineConfig(model=str(llama.base), adapter_root=str(llama.adapter_root), page_size=8,
                          max_batch_tokens=1024, **target)  # type: ignore[arg-type]  # fmt: skip
    engine = LLMEngine(config)
    before = engine.stats()
    for prompt, adapter, n in zip(prompts, adapters, lengths):
        engine.add_request(prompt, adapter, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    keys = ("steps_decode", "steps_prompt", "step_requests_decode", "step_requests_prompt", "step_prompt_tokens")
    grew = {key: getattr(stats, key) - getattr(before, key) for key in keys}
    # No prompt is chunked (1024 tokens a step) and nothing is preempted: each prompt is computed once, and a request
    # is in one step per token it samples.
    assert engine.scheduler.num_preemptions == 0
    assert grew["step_prompt_tokens"] == sum(len(p) for p in prompts)
    assert grew["step_requests_decode"] + grew["step_requests_prompt"] == sum(lengths)
    assert 1 <= grew["steps_prompt"] <= len(prompts)  # requests arriving together are admitted in few steps
    assert grew["step_requests_prompt"] >= len(prompts)  # each request's first token comes from a prompt step
    assert grew["steps_decode"] >= max(lengths) - 1
    assert stats.step_seconds_decode > before.step_seconds_decode and stats.step_seconds_prompt > 0
    # on the CPU a step is timed on the host: its wall time is its time
    assert stats.step_wall_seconds_decode - before.step_wall_seconds_decode == pytest.approx(
        stats.step_seconds_decode - before.step_seconds_decode
    )


def test_a_step_counts_under_its_kind() -> None:
    totals = StepTotals()
    totals.add(Step(0.01, 0, 4))
    totals.add(Step(0.03, 120, 5, wall_s=0.05))  # timed on the device: the GPU waited 20 ms for the host
    totals.add(Step(0.02, 0, 6, wall_s=0.02))
    decode, prompt = totals.kinds["decode"], totals.kinds["prompt"]
    assert (decode.steps, decode.requests, prompt.steps, prompt.requests) == (2, 10, 1, 5)
    assert (decode.seconds, prompt.seconds, totals.prompt_tokens) == (pytest.approx(0.03), 0.03, 120)
    assert (decode.wall_seconds, prompt.wall_seconds) == (pytest.approx(0.03), 0.05)
    # every total is an EngineStats counter, continued when an engine process is started again
    assert set(totals.as_stats()) <= set(STATS_COUNTERS) and totals.as_stats()["step_requests_decode"] == 10
