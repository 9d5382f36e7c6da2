"""Inter-token-latency admission (EngineConfig.itl_slo_s, backend/engine/batch_limit.py): the cap's moves, and,
on the scheduler stepped without a model with steps that grow with the batch, that it keeps steps near the target
where the uncapped batch does not, while under fair a light tenant's requests are admitted ahead of a flood's
backlog; then the engine with it gives the same tokens."""

from __future__ import annotations

import logging
import random
import statistics

import pytest

from slora.backend.config import EngineConfig
from slora.backend.engine.batch_limit import DECREASE, FAST_GROWTH, FAST_LEAST, FLOOR, WINDOW, BatchLimiter
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.engine.step_clock import Step
from tests.engine.scheduler_sim import Sim, make_request, make_sim
from tests.model_fixtures import ModelWithAdapters

TARGET_S = 0.02
BASE_S, PER_SEQ_S = 0.002, 0.001  # the simulated step: fixed cost plus a cost per running request
STEADY_CAP = (TARGET_S - BASE_S) / PER_SEQ_S  # the batch at which steps take TARGET_S: 18
FLOOD, SETTLED = 600, 250


def _decodes(limiter: BatchLimiter, seconds: float, batch: int, n: int = WINDOW, held: bool = True) -> None:
    for _ in range(n):
        limiter.observe(Step(seconds, 0, batch), held)


def test_no_verdict_before_a_window_of_decode_steps_then_a_cut_by_the_overshoot() -> None:
    limiter = BatchLimiter(TARGET_S, max_num_seqs=64)
    _decodes(limiter, 0.022, 40, n=WINDOW - 1)
    assert limiter.cap == 64 and limiter.step_s is None  # a fresh engine's first steps move nothing
    _decodes(limiter, 0.022, 40, n=1)  # 10% over: cut by 10%
    assert limiter.cap == int(40 * TARGET_S / 0.022) == 36
    far = BatchLimiter(TARGET_S, max_num_seqs=64)
    _decodes(far, 0.1, 40)  # five times over: the deepest cut, FLOOR
    assert far.cap == int(40 * FLOOR) == 32
    near = BatchLimiter(TARGET_S, max_num_seqs=64)
    _decodes(near, 0.0201, 40)  # just over: the least cut, DECREASE
    assert near.cap == int(40 * DECREASE) == 38


def test_after_a_cut_the_steps_of_the_draining_batch_are_left_out() -> None:
    limiter = BatchLimiter(TARGET_S, max_num_seqs=64)
    _decodes(limiter, 0.1, 40)
    assert limiter.cap == 32
    for batch in range(39, 32, -1):  # draining down to the cap, a request fewer every few steps: no second cut
        _decodes(limiter, 0.1, batch, n=WINDOW - 1)
    assert limiter.cap == 32 and limiter.step_s is None
    _decodes(limiter, 0.1, 32, n=WINDOW - 1)
    assert limiter.cap == 32, "a verdict needs a whole window of steps at the cap"
    _decodes(limiter, 0.1, 32, n=1)
    assert limiter.cap == int(32 * FLOOR)


def test_a_batch_that_stays_above_the_cap_counts_and_cuts_it_only_below_its_own_cut() -> None:
    """Slot shares let light tenants past the cap: a batch above it that no longer shrinks is not draining."""
    limiter = BatchLimiter(TARGET_S, max_num_seqs=64)
    _decodes(limiter, 0.0201, 40)
    assert limiter.cap == 38
    _decodes(limiter, 0.0201, 41, n=WINDOW + 1)  # the draining rule's patience: WINDOW steps without a lesser batch
    assert limiter.step_s is None
    _decodes(limiter, 0.0201, 41, n=6 * WINDOW)  # just over the target: 41 × DECREASE is not below the cap
    assert limiter.cap == 38
    _decodes(limiter, 0.1, 41, n=WINDOW)  # five times over: 41 × FLOOR = 32, below the cap
    assert limiter.cap == int(41 * FLOOR) == 32


def test_a_batch_above_the_cap_that_meets_the_target_grows_it_while_requests_are_held() -> None:
    """Or a cap cut by a start-up burst would stay where the burst left it."""
    limiter = BatchLimiter(TARGET_S, max_num_seqs=256)
    _decodes(limiter, 0.1, 20)
    assert limiter.cap == 16
    _decodes(limiter, 0.01, 10, n=1, held=False)  # the burst is over: its batch drained below the cap
    _decodes(limiter, 0.01, 40, n=WINDOW - 2)  # then 40 running past the cap, steps half the target
    assert limiter.cap == 16
    _decodes(limiter, 0.01, 40, n=1)
    assert limiter.cap == 16 + FAST_LEAST
    _decodes(limiter, 0.01, 40, n=5, held=False)  # nothing held back: no evidence that the cap is too low
    assert limiter.cap == 16 + FAST_LEAST
    limiter.cap = 78
    _decodes(limiter, 0.01, 40, n=1)
    assert limiter.cap == int(40 * TARGET_S / 0.01) == 80, "no further than what the window's steps allow"


def test_prefill_steps_and_the_odd_slow_step_cut_nothing() -> None:
    limiter = BatchLimiter(TARGET_S, max_num_seqs=64)
    for _ in range(100):  # admission every other step (admit_interval=2), of long prompts: not the batch's doing
        limiter.observe(Step(0.08, 512, 40), True)
        limiter.observe(Step(0.015, 0, 40), False)
    assert limiter.cap == 64 and limiter.step_s == pytest.approx(0.015)
    limiter = BatchLimiter(TARGET_S, max_num_seqs=64)
    for k in range(3 * WINDOW):
        limiter.observe(Step(0.5 if k % WINDOW == 3 else 0.015, 0, 40), False)  # a compile, a collection
    assert limiter.cap == 64 and limiter.step_s == pytest.approx(0.015)


def test_when_every_step_computes_prompts_they_count_after_a_window_of_them() -> None:
    limiter = BatchLimiter(TARGET_S, max_num_seqs=64)
    for _ in range(WINDOW - 1):
        limiter.observe(Step(0.1, 64, 40), True)
    limiter.observe(Step(0.01, 0, 40), True)  # a decode step ends the run
    for _ in range(WINDOW - 1):
        limiter.observe(Step(0.1, 64, 40), True)
    assert limiter.cap == 64 and limiter.step_s is None
    for _ in range(WINDOW):  # a chunked prompt, or admission at every step: now each counts
        limiter.observe(Step(0.1, 64, 40), True)
    assert limiter.cap == int(40 * FLOOR)


def test_the_cap_grows_by_one_a_step_while_it_holds_requests_back_and_steps_are_fast() -> None:
    limiter = BatchLimiter(TARGET_S, max_num_seqs=64)
    _decodes(limiter, 0.1, 20)
    assert limiter.cap == 16
    _decodes(limiter, 0.018, 16, n=WINDOW - 1)  # under the target, not far under it: one a step
    for expected in (17, 18, 19):
        limiter.observe(Step(0.018, 0, limiter.cap), True)
        assert limiter.cap == expected
    limiter.observe(Step(0.018, 0, 19), False)  # the cap held nobody back: no evidence that more would be fast
    assert limiter.cap == 19
    limiter.cap = 64
    limiter.observe(Step(0.01, 0, 64), True)
    assert limiter.cap == 64  # never above max_num_seqs


def test_far_under_the_target_the_cap_grows_by_a_fraction_of_itself() -> None:
    limiter = BatchLimiter(TARGET_S, max_num_seqs=512)
    _decodes(limiter, 0.1, 40)
    assert limiter.cap == 32
    _decodes(limiter, 0.005, 32, n=WINDOW - 1)
    caps = []
    for _ in range(3 * WINDOW):  # a cut the load no longer needs: back within a few windows
        limiter.observe(Step(0.005, 0, limiter.cap), True)
        caps.append(limiter.cap)
    assert caps[:3] == [36, 40, 44] and caps[-1] >= 6 * 32
    assert all(b - a == min(512 - a, max(FAST_LEAST, a // FAST_GROWTH)) for a, b in zip(caps, caps[1:]))


def test_a_batch_of_one_is_never_cut_and_the_miss_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    limiter = BatchLimiter(TARGET_S, max_num_seqs=64)
    with caplog.at_level(logging.WARNING, logger="slora.backend.engine.batch_limit"):
        _decodes(limiter, 0.05, 1, n=3 * WINDOW)
    assert limiter.cap == 64
    assert [r.getMessage() for r in caplog.records] == [
        "itl_slo_s=0.02 s cannot be met: decode steps of one request take 0.05 s"
    ]


def test_the_scheduler_gives_the_limiter_its_steps_without_the_wait_for_work() -> None:
    limiter = BatchLimiter(TARGET_S, max_num_seqs=64)
    sim = make_sim("fcfs", pages=400, max_num_seqs=64, limiter=limiter)
    sim.pace = lambda batch: 0.01
    for i in range(4):
        sim.add(make_request(f"r{i}", "t", 1, 40))  # prompts of one token: every step is a decode step
    sim.run()
    assert limiter.step_s == pytest.approx(0.01)
    sim.clock.now += 100.0  # idle: the next plan's lap is no step
    sim.add(make_request("late", "t", 1, 5))
    sim.run()
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
    sim = make_sim(policy, pages=4000, max_num_seqs=64, limiter=limiter, admit_interval=2)  # as on a GPU
    sim.pace = lambda batch: BASE_S + PER_SEQ_S * batch
    rng = random.Random(7)
    for i in range(FLOOD):
        sim.add(make_request(f"flood-{i}", "flood", rng.randint(4, 24), rng.randint(10, 50)))
    return sim


def test_the_cap_keeps_steps_near_the_target_and_fair_admits_the_light_tenant_first() -> None:
    steps, waits, batches = {}, {}, {}
    for policy, limited in (("fair", True), ("fcfs", True), ("fair", False)):
        sim = _sim(policy, limited)
        steps[policy, limited], waited = _run(sim, light_every=25, lights=12)
        batches[policy, limited] = [len(plan.seqs) for plan in sim.plans[SETTLED:-100]]
        waits[policy, limited] = [waited[f"light-{i}"] for i in range(12)]
        assert len(sim.finished) == FLOOD + 12 and not sim.scheduler.running
    capped = steps["fair", True][SETTLED:-100]  # the first batch of 64 (admitted before any step was timed) cut
    # by at most FLOOR a window, each cut waiting for the batch to drain to it: settled after SETTLED steps
    assert statistics.mean(capped) <= 1.1 * TARGET_S and max(capped) <= 1.3 * TARGET_S
    assert statistics.median(batches["fair", True]) >= 0.8 * STEADY_CAP  # not cut far below what meets the target
    assert statistics.mean(steps["fair", False][:200]) > 2 * TARGET_S  # uncapped: the flood fills the batch
    fair_waits = waits["fair", True]
    assert max(fair_waits) <= max(waits["fair", False]), "slot shares: admitted at once, as without a cap"
    assert min(waits["fcfs", True]) > 100  # behind it under fcfs: the cap alone does not make the light one wait less


def test_the_engine_with_the_cap_gives_the_same_tokens(llama: ModelWithAdapters) -> None:
    config = EngineConfig(model=str(llama.base), adapter_root=str(llama.adapter_root), device="cpu", dtype="float32",
                          page_size=8, max_num_seqs=8, warmup=False)  # fmt: skip
    prompts = [[5, 9, 14, 2, 7], [3] * 30, [11, 12], [8, 1, 4]]
    adapters = [llama.adapters[0], None, llama.adapters[1], llama.adapters[2]]
    greedy = SamplingParams(max_tokens=WINDOW + 8, temperature=0.0, ignore_eos=True)  # a window of decode steps
    expected = LLMEngine(config).generate(prompts, adapters, greedy)
    capped = LLMEngine(EngineConfig.from_dict({**config.__dict__, "itl_slo_s": "0.0001"}))
    assert capped.scheduler.limiter is not None and capped.scheduler.limiter.max_num_seqs == 8
    got = capped.generate(prompts, adapters, greedy)  # steps slower than the target: the cap cut, still served
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert capped.scheduler.limiter.cap < 8 and capped.stats().max_running == capped.scheduler.limiter.cap
    assert capped.stats().heavy_max_running == capped.stats().max_running  # fcfs: no second cap
    assert LLMEngine(config).stats().max_running == 8 == LLMEngine(config).stats().heavy_max_running  # uncapped
    fair = LLMEngine(EngineConfig.from_dict({**config.__dict__, "itl_slo_s": "0.0001", "scheduling_policy": "fair"}))
    fair.generate(prompts, adapters, greedy)
    heavy = fair.scheduler.heavy_limiter
    assert (
        heavy is not None
        and heavy.cap < 8
        and fair.stats().heavy_max_running == min(heavy.cap, fair.stats().max_running)
    )


@pytest.mark.parametrize("value", [0, -1, "inf", "nan"])
def test_a_bad_itl_slo_names_the_field(value: object) -> None:
    with pytest.raises(ValueError, match="itl_slo_s"):
        EngineConfig.from_dict({"itl_slo_s": value})
