"""Inter-token-latency admission (EngineConfig.itl_slo_s, backend/engine/batch_limit.py): the cap's moves, and,
on the scheduler stepped without a model with steps that grow with the batch, that it keeps steps near the target
where the uncapped batch does not, while under fair a light tenant's requests are admitted ahead of a flood's
backlog; then the engine with it gives the same tokens."""

from __future__ import annotations

import random
import statistics

import pytest

from slora.backend.config import EngineConfig
from slora.backend.engine.batch_limit import COOLDOWN_STEPS, BatchLimiter
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.sampling_params import SamplingParams
from tests.engine.scheduler_sim import Sim, make_request, make_sim
from tests.model_fixtures import ModelWithAdapters

TARGET_S = 0.02
BASE_S, PER_SEQ_S = 0.002, 0.001  # the simulated step: fixed cost plus a cost per running request
STEADY_CAP = (TARGET_S - BASE_S) / PER_SEQ_S  # the batch at which steps take TARGET_S: 18


def test_the_cap_falls_below_what_ran_when_steps_are_slow_then_waits() -> None:
    limiter = BatchLimiter(TARGET_S, max_num_seqs=64)
    now = 0.0
    limiter.planned(now, 40)
    now += 0.05
    limiter.planned(now, 40)  # one step far over the target: the deepest cut, half of what ran
    assert limiter.cap == 20
    for _ in range(COOLDOWN_STEPS):  # the average still shows the larger batch: no second cut meanwhile
        now += 0.05
        limiter.planned(now, 40)
        assert limiter.cap == 20
    now += 0.05
    limiter.planned(now, 30)
    assert limiter.cap == 15
    just_over = BatchLimiter(TARGET_S, max_num_seqs=64)
    just_over.planned(0.0, 40)
    just_over.planned(0.021, 40)  # just over: the least cut, 0.9 of what ran
    assert just_over.cap == 36


def test_the_cap_grows_by_one_a_step_while_it_binds_and_steps_are_fast() -> None:
    limiter = BatchLimiter(TARGET_S, max_num_seqs=64)
    limiter.cap = 10
    now = 0.0
    limiter.planned(now, 10)
    for expected in (11, 12, 13):
        now += 0.01
        limiter.planned(now, limiter.cap)
        assert limiter.cap == expected
    now += 0.01
    limiter.planned(now, 5)  # fast, but the cap does not bind: it stays
    assert limiter.cap == 13
    limiter.cap = 64
    now += 0.01
    limiter.planned(now, 64)
    assert limiter.cap == 64  # never above max_num_seqs


def test_idle_time_is_no_step() -> None:
    limiter = BatchLimiter(TARGET_S, max_num_seqs=64)
    limiter.planned(0.0, 8)
    limiter.planned(0.01, 8)
    assert limiter.step_s == pytest.approx(0.01)
    limiter.planned(0.02, 0)  # nothing runs from here ...
    limiter.planned(100.0, 8)  # ... until now: not a 100 s step
    limiter.idle()
    limiter.planned(200.0, 8)
    assert limiter.step_s == pytest.approx(0.01) and limiter.cap == 64


def _run(sim: Sim, light_every: int, lights: int) -> tuple[list[float], dict[str, int]]:
    """Step `sim` (its queue holds a flood) with steps that grow with the batch, a light tenant's request arriving
    every `light_every` plans; returns each step's seconds and each light request's plans from arrival to start."""
    arrived: dict[str, int] = {}
    waited: dict[str, int] = {}
    while sim.scheduler.has_work() or len(arrived) < lights:
        if sim.steps % light_every == 0 and len(arrived) < lights:
            rid = f"light-{len(arrived)}"
            sim.add(make_request(rid, "light", 8, 30, arrival=sim.clock.now))
            arrived[rid] = sim.steps
        plan = sim.step()
        for seq in plan.seqs:
            rid = seq.request.request_id
            if rid in arrived and rid not in waited:
                waited[rid] = sim.steps - 1 - arrived[rid]
        assert sim.steps < 20_000, "the scheduler did not finish"
    return sim.durations, waited


def _sim(policy: str, limited: bool) -> Sim:
    limiter = BatchLimiter(TARGET_S, max_num_seqs=64) if limited else None
    sim = make_sim(policy, pages=4000, max_num_seqs=64, limiter=limiter)
    sim.pace = lambda batch: BASE_S + PER_SEQ_S * batch
    rng = random.Random(7)
    for i in range(300):
        sim.add(make_request(f"flood-{i}", "flood", rng.randint(4, 24), rng.randint(10, 50)))
    return sim


def test_the_cap_keeps_steps_near_the_target_and_fair_admits_the_light_tenant_first() -> None:
    steps, waits = {}, {}
    for policy, limited in (("fair", True), ("fcfs", True), ("fair", False)):
        sim = _sim(policy, limited)
        steps[policy, limited], waited = _run(sim, light_every=25, lights=12)
        waits[policy, limited] = [waited[f"light-{i}"] for i in range(12)]
        assert len(sim.finished) == 312 and not sim.scheduler.running
    capped = steps["fair", True][60:300]  # once the first batch (64, admitted before any step was timed) has gone
    assert statistics.mean(capped) <= 1.1 * TARGET_S and max(capped) <= 1.3 * TARGET_S
    assert statistics.mean(steps["fair", False][:200]) > 2 * TARGET_S  # uncapped: the flood fills the batch
    fair_waits = waits["fair", True]
    assert statistics.median(fair_waits) <= 4 and max(fair_waits[2:]) <= 10  # ahead of the flood's backlog
    assert min(waits["fcfs", True]) > 100  # behind it under fcfs: the cap alone does not make the light one wait less


def test_the_engine_with_the_cap_gives_the_same_tokens(llama: ModelWithAdapters) -> None:
    config = EngineConfig(model=str(llama.base), adapter_root=str(llama.adapter_root), device="cpu", dtype="float32",
                          page_size=8, max_num_seqs=8, warmup=False)  # fmt: skip
    prompts = [[5, 9, 14, 2, 7], [3] * 30, [11, 12], [8, 1, 4]]
    adapters = [llama.adapters[0], None, llama.adapters[1], llama.adapters[2]]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = LLMEngine(config).generate(prompts, adapters, greedy)
    capped = LLMEngine(EngineConfig.from_dict({**config.__dict__, "itl_slo_s": "0.0001"}))
    assert capped.scheduler.limiter is not None and capped.scheduler.limiter.max_num_seqs == 8
    got = capped.generate(prompts, adapters, greedy)  # steps slower than the target: a cap of one, still served
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert capped.scheduler.limiter.cap < 8 and capped.stats().max_running == capped.scheduler.limiter.cap
    assert LLMEngine(config).stats().max_running == 8  # uncapped: max_num_seqs


@pytest.mark.parametrize("value", [0, -1, "inf", "nan"])
def test_a_bad_itl_slo_names_the_field(value: object) -> None:
    with pytest.raises(ValueError, match="itl_slo_s"):
        EngineConfig.from_dict({"itl_slo_s": value})
