"""The engine's step totals (step_totals.py, EngineStats.steps_*): what its steps computed adds up to what its
requests asked for, counted from the requests themselves."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.outputs import STATS_COUNTERS
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.engine.step_clock import Step
from slora.backend.engine.step_totals import StepTotals
from slora.backend.memory.adapter_copier import AdapterCopier
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
    wall = stats.step_wall_seconds_decode - before.step_wall_seconds_decode
    device = stats.step_seconds_decode - before.step_seconds_decode
    if target["device"] == "cpu":
        assert wall == pytest.approx(device)  # on the CPU a step is timed on the host: its wall time is its time
    else:
        # timed on the GPU: the steps run one after the other on one stream, within the time that passed between
        # their plans and their tokens, which also holds the launches and the host's waits
        assert 0 < device <= wall


def test_a_step_counts_under_its_kind() -> None:
    totals = StepTotals()
    totals.add(Step(0.01, 0, 4))
    # timed on the device: the GPU waited 20 ms between steps, 4 ms of them for the step's adapter copies
    totals.add(Step(0.03, 120, 5, wall_s=0.05), copy_wait_s=0.004)
    totals.add(Step(0.02, 0, 6, wall_s=0.02))
    decode, prompt = totals.kinds["decode"], totals.kinds["prompt"]
    assert (decode.steps, decode.requests, prompt.steps, prompt.requests) == (2, 10, 1, 5)
    assert (decode.seconds, prompt.seconds, totals.prompt_tokens) == (pytest.approx(0.03), 0.03, 120)
    assert (decode.wall_seconds, prompt.wall_seconds) == (pytest.approx(0.03), 0.05)
    assert (decode.copy_wait_seconds, prompt.copy_wait_seconds) == (0.0, 0.004)
    # every total is an EngineStats counter, continued when an engine process is started again
    assert set(totals.as_stats()) <= set(STATS_COUNTERS) and totals.as_stats()["step_requests_decode"] == 10


GPU_SLEEP_CYCLES = 400_000_000  # about 0.2-0.4 s at a datacenter GPU's clocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="adapter copies the device waits for run on CUDA only")
def test_the_device_waiting_for_an_adapter_copy_is_counted_apart(
    llama: ModelWithAdapters, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy held up on its stream (a GPU sleep in front of it) holds up the first step that reads the adapter:
    the totals count that wait as copy wait, not as the step's own time."""
    copy = AdapterCopier._copy

    def held_up(self: AdapterCopier, *args: Any) -> Any:
        with torch.cuda.stream(self._stream):
            torch.cuda._sleep(GPU_SLEEP_CYCLES)
        return copy(self, *args)

    monkeypatch.setattr(AdapterCopier, "_copy", held_up)
    config = EngineConfig(model=str(llama.base), adapter_root=str(llama.adapter_root), page_size=8, device="cuda",
                          preload_adapters=False, warmup=False, cuda_graphs=False)  # fmt: skip
    engine = LLMEngine(config)
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    engine.generate([[5, 6, 7]], [llama.adapters[0]], greedy)  # the kernels compiled, outside the steps measured
    engine.cache.drop_stale(set())  # so that the adapter is copied again
    before = engine.stats()
    engine.generate([[5, 6, 7]], [llama.adapters[0]], greedy)
    stats = engine.stats()
    waited = stats.step_copy_wait_seconds_prompt - before.step_copy_wait_seconds_prompt
    computed = stats.step_seconds_prompt - before.step_seconds_prompt
    assert waited > 0.05, waited
    assert computed < waited, (computed, waited)
    assert stats.step_copy_wait_seconds_decode == before.step_copy_wait_seconds_decode  # the adapter was copied
