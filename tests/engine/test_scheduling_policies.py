"""Scheduling policies (fcfs, fair = VTC, priority) and SLO-aware admission, tested on their properties.

Most tests step the scheduler without a model (scheduler_sim.py): thousands of steps, random lengths. The
engine tests run the tiny random Llama with adapters: preemption and adapter eviction under each policy, fcfs's
schedule against the one recorded before policies existed, SLO refusals end to end, and bad values refused.
"""

from __future__ import annotations

import json
import logging
import pickle
import random
import re
import threading
import time
from pathlib import Path

import pytest

from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.outputs import RequestOutput
from slora.backend.engine.request import Request
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.engine.scheduler import SchedulerOutput
from slora.backend.engine.scheduling_policy import FairPolicy
from slora.backend.engine.slo import RateMeter, RefusalReason, SloSettings
from slora.backend.engine.step_clock import Step, StepClock
from slora.backend.engine.tenants import BASE_TENANT, TenantBook, load_weights_file
from slora.backend.errors import EngineOverloadedError, InvalidRequestError, SloRefusedError
from slora.backend.memory.page_pool import PageKind
from tests.engine import schedule_trace
from tests.engine.scheduler_sim import BLOCK, Sim, flood, kv_tokens, make_request, make_sim
from tests.model_fixtures import ModelWithAdapters
from tests.runtime.callback_engine import CallbackEngine

PROMPT = (4, 24)
OUTPUT = (2, 24)


def vtc_bound(sim: Sim, weights: tuple[float, float] = (1.0, 1.0)) -> float:
    """The paper's bound on the service gap of two backlogged tenants: 2·max(w_p·L, w_q·M) over the least weight,
    L the longest prompt, M the most tokens a running batch can hold (here: the pool's KV tokens)."""
    m = sim.scheduler.pool.num_pages * BLOCK
    return 2 * max(1.0 * PROMPT[1], 2.0 * m) / min(weights)


# ---- fair (VTC) ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fair_keeps_two_backlogged_tenants_within_the_vtc_bound(seed: int) -> None:
    """A flood queued first and a tenant queued after it: fair serves both within the bound; fcfs does not."""
    gaps = {}
    for policy in ("fair", "fcfs"):
        sim = make_sim(policy, pages=60, max_num_seqs=6)
        flood(sim, "flood", 150, PROMPT, OUTPUT, seed)
        flood(sim, "light", 150, PROMPT, OUTPUT, seed + 100)
        sim.run()
        gaps[policy] = sim.max_service_gap("flood", "light")
        assert len(sim.finished) == 300 and kv_tokens(sim) == 0
    assert gaps["fair"] <= vtc_bound(sim)
    assert gaps["fcfs"] > 3 * vtc_bound(sim), "the test must be one that fcfs fails"


def test_weighted_tenants_are_served_in_proportion() -> None:
    sim = make_sim("fair", pages=60, max_num_seqs=6, weights={"gold": 3.0})
    flood(sim, "gold", 200, PROMPT, OUTPUT, seed=4)
    flood(sim, "bronze", 200, PROMPT, OUTPUT, seed=5)
    sim.run(until=lambda: not {"gold", "bronze"} <= sim.backlogged[-1] if sim.backlogged else False)
    assert sim.max_service_gap("gold", "bronze") <= vtc_bound(sim, (3.0, 1.0))
    raw_gold = sum(sim.service["gold"]) * 3.0  # service is divided by the weight: undo it
    assert 2.0 < raw_gold / sum(sim.service["bronze"]) < 4.5


def test_weights_changed_at_runtime_take_effect() -> None:
    sim = make_sim("fair", pages=60, max_num_seqs=6)
    flood(sim, "a", 300, PROMPT, OUTPUT, seed=6)
    flood(sim, "b", 300, PROMPT, OUTPUT, seed=7)
    for _ in range(150):
        sim.step()
    before = [sum(sim.service[t]) for t in ("a", "b")]
    sim.scheduler.book.set_weights({"a": 4.0})
    for _ in range(400):
        sim.step()
    raw_a = (sum(sim.service["a"]) - before[0]) * 4.0
    assert raw_a / (sum(sim.service["b"]) - before[1]) > 2.5


@pytest.mark.parametrize("policy", ["fair", "priority"])
def test_one_tenant_alone_is_scheduled_as_fcfs_would(policy: str) -> None:
    """Work-conserving with nobody to share with: a single tenant gets exactly fcfs's schedule."""
    lines = {}
    for name in ("fcfs", policy):
        sim = make_sim(name, pages=50, max_batch_tokens=40, max_num_seqs=5)
        flood(sim, "only", 60, PROMPT, OUTPUT, seed=8)
        sim.run()
        lines[name] = [[(s.request.request_id.split("-")[0], s.num_tokens) for s in p.seqs] for p in sim.plans]
    assert lines[policy] == lines["fcfs"]


@pytest.mark.parametrize("seed", [9, 10])
def test_fair_is_work_conserving(seed: int) -> None:
    """Right after every plan, requests wait only when the batch, the token budget or the pool is full."""
    sim = make_sim("fair", pages=80, max_batch_tokens=64, max_num_seqs=6)
    s = sim.scheduler
    schedule = s.schedule
    checked = 0

    def checked_schedule() -> SchedulerOutput:
        nonlocal checked
        plan = schedule()
        head = s.policy.peek()
        if head is not None and not plan.preempted:
            full = len(s.running) >= s.limits.max_num_seqs or plan.num_tokens >= s.limits.max_batch_tokens
            assert full or s.pool.num_free < -(-head.num_tokens // BLOCK), "idle capacity while requests wait"
            checked += 1
        return plan

    s.schedule = checked_schedule  # type: ignore[method-assign]
    rng = random.Random(seed)
    for step in range(400):
        if step % 5 == 0:
            for tenant in rng.sample(["a", "b", "c", "d"], rng.randint(0, 3)):
                flood(sim, tenant, rng.randint(1, 4), PROMPT, OUTPUT, seed=rng.randrange(1 << 30))
        if s.has_work():
            sim.step()
    assert checked > 50, "the test must have requests waiting"


def test_a_tenant_back_from_idle_gets_no_burst_of_credit() -> None:
    """A tenant idle while another was served comes back lifted to the backlogged counters: from then on the two
    stay within the bound, instead of the returning tenant taking the engine until its old deficit is repaid."""
    sim = make_sim("fair", pages=60, max_num_seqs=6)
    flood(sim, "steady", 400, PROMPT, OUTPUT, seed=11)
    flood(sim, "away", 5, PROMPT, OUTPUT, seed=12)
    sim.run(until=lambda: sim.steps > 50 and "away" not in {r.tenant for r in sim.scheduler.running}
            and "away" not in sim.backlogged[-1])  # fmt: skip
    for _ in range(400):  # "away" is idle; "steady" is served alone
        sim.step()
    policy = sim.scheduler.policy
    assert isinstance(policy, FairPolicy)
    old = policy.counters["away"]
    assert policy.counters["steady"] > old + 3 * vtc_bound(sim)
    start = sim.steps
    flood(sim, "away", 200, PROMPT, OUTPUT, seed=13)
    assert policy.counters["away"] == policy.counters["steady"], "lifted to the least backlogged counter"
    for _ in range(300):
        sim.step()
    away = sum(sim.service["away"][start:])
    steady = sum(sim.service["steady"][start:])
    assert abs(away - steady) <= vtc_bound(sim)


def test_lift_with_nothing_backlogged_uses_the_last_tenant_to_leave() -> None:
    book = TenantBook()
    policy = FairPolicy(book, 1.0, 2.0)
    first = make_request("x", "x", 10, 1)
    policy.push(first)
    policy.take(first)  # "x" leaves the queue, charged its prompt
    assert policy.counters["x"] == 10.0
    policy.push(make_request("y", "y", 3, 1))
    assert policy.counters["y"] == 10.0, "idle engine: lifted to the counter of the last tenant to leave"


def test_preemption_requeues_at_the_tenant_head_without_charging_again() -> None:
    sim = make_sim("fair", pages=14, max_num_seqs=8)
    for tenant in ("a", "b"):
        for i in range(4):
            sim.add(make_request(f"{tenant}{i}", tenant, 8, 40))
    sim.run()
    assert sim.scheduler.num_preemptions > 0 and len(sim.finished) == 8 and kv_tokens(sim) == 0
    policy = sim.scheduler.policy
    assert isinstance(policy, FairPolicy)
    for tenant in ("a", "b"):  # each prompt counted once, each output token once
        assert policy.counters[tenant] == 4 * 8 * 1.0 + 4 * 40 * 2.0


@pytest.mark.parametrize("policy", ["fair", "priority"])
def test_running_requests_stay_in_admission_order(policy: str) -> None:
    """No policy reorders the running requests (consecutive decode steps keep one batch, decode_batch.py):
    each step's running list is the last one's survivors, in their order, then the new admissions."""
    sim = make_sim(policy, pages=40, max_batch_tokens=48, max_num_seqs=6)
    flood(sim, "a", 60, PROMPT, OUTPUT, seed=14)
    flood(sim, "b", 60, PROMPT, OUTPUT, seed=15)
    before: list[object] = []
    while sim.scheduler.has_work():
        sim.step()
        now = list(sim.scheduler.running)
        kept = [r for r in before if r in now]
        assert now[: len(kept)] == kept
        before = now
    assert sim.scheduler.num_preemptions > 0


def test_fair_preempts_a_request_of_the_most_served_tenant() -> None:
    sim = make_sim("fair", pages=30, max_num_seqs=8)
    policy = sim.scheduler.policy
    assert isinstance(policy, FairPolicy)
    flood(sim, "a", 40, PROMPT, OUTPUT, seed=16)
    flood(sim, "b", 40, PROMPT, OUTPUT, seed=17)
    choose = policy.victim
    chosen: list[tuple[float, float]] = []

    def recorded(candidates: list[Request]) -> Request:
        victim = choose(candidates)
        chosen.append((policy.counters[victim.tenant], max(policy.counters[r.tenant] for r in candidates)))
        return victim

    policy.victim = recorded  # type: ignore[method-assign]
    sim.run()
    assert chosen and all(mine == most for mine, most in chosen)


# ---- priority --------------------------------------------------------------------------------------------------


def test_priority_orders_higher_first() -> None:
    sim = make_sim("priority", max_num_seqs=1)
    for i, p in enumerate([0, 5, 1, 5, 9]):
        sim.add(make_request(f"r{i}", BASE_TENANT, 4, 2, arrival=sim.clock.now, priority=p))
    sim.run()
    admitted = [p.seqs[0].request.request_id for p in sim.plans if p.seqs and p.seqs[0].num_tokens > 1]
    assert admitted == ["r4", "r1", "r3", "r2", "r0"]


@pytest.mark.parametrize("aging_rate", [10.0, 40.0])
def test_priority_with_aging_never_starves(aging_rate: float) -> None:
    """A stream of priority-10 requests above capacity: a priority-0 request is overtaken only by those that
    arrive within 10 / aging_rate seconds after it, and then runs."""
    sim = make_sim("priority", max_num_seqs=2, aging_rate=aging_rate)
    low = make_request("low", BASE_TENANT, 4, 2, arrival=sim.clock.now, priority=0)
    sim.add(low)
    ahead_of_low: list[float] = []
    for step in range(3000):
        for k in range(2):
            sim.add(make_request(f"hi{step}-{k}", BASE_TENANT, 4, 4, arrival=sim.clock.now, priority=10))
        plan = sim.step()
        if low.num_computed:
            break
        ahead_of_low += [s.request.arrival_time for s in plan.seqs if s.request.num_computed == s.num_tokens]
    assert low.num_computed, "the low-priority request never ran"
    assert max(ahead_of_low) - low.arrival_time <= 10 / aging_rate + 1e-9
    assert len(sim.scheduler.waiting) > 50, "the stream must exceed capacity, else nothing could starve"


def test_priority_without_real_aging_starves_the_low_one() -> None:
    """The counterpart: with aging too slow to matter, the low-priority request is still waiting."""
    sim = make_sim("priority", max_num_seqs=2, aging_rate=1e-6)
    low = make_request("low", BASE_TENANT, 4, 2, arrival=sim.clock.now, priority=0)
    sim.add(low)
    for step in range(300):
        for _ in range(2):
            sim.add(make_request(f"hi{step}-{_}", BASE_TENANT, 4, 4, arrival=sim.clock.now, priority=10))
        sim.step()
    assert not low.finished and low in sim.scheduler.waiting


# ---- SLO-aware admission ---------------------------------------------------------------------------------------


def test_rate_meter_counts_only_admission_rounds_that_left_requests_waiting() -> None:
    meter = RateMeter(window_s=10.0, min_busy_s=0.5)
    t = 0.0
    for _ in range(50):  # rounds every other 0.1 s step; 2 admitted per round while requests wait: 10 a second
        meter.observe(Step(0.1, 64, 4))
        meter.planned(t, 0, admission=False, waiting=True)  # admission not due: says nothing of the rate
        t += 0.1
        meter.observe(Step(0.1, 64, 4))
        meter.planned(t, 2, admission=True, waiting=True)
        t += 0.1
    for _ in range(50):  # rounds that admit everyone waiting: arrivals set the pace, not counted
        meter.observe(Step(0.1, 0, 4))
        meter.planned(t, 1, admission=True, waiting=False)
        t += 0.1
    assert meter.admitted_per_s() == pytest.approx(10.0)
    assert meter.step_s == pytest.approx(0.1)
    assert meter.prefill_s(640) == pytest.approx(1.0, rel=0.05)  # 64 prompt tokens per 0.1 s step
    meter.idle()
    meter.planned(t + 1.0, 0, admission=True, waiting=True)  # the idle second is no round
    assert meter.admitted_per_s() == pytest.approx(10.0)
    meter.planned(t + 100.0, 0, admission=True, waiting=True)
    assert meter.admitted_per_s() is None, "the rounds of long ago have left the window"


def test_rate_meter_gives_no_rate_while_limited_rounds_admit_none() -> None:
    meter = RateMeter(window_s=10.0, min_busy_s=0.5)
    for k in range(20):
        meter.planned(0.1 * k, 0, admission=True, waiting=True)
    assert meter.admitted_per_s() is None


def test_the_step_clock_times_each_step_to_its_tokens_and_not_the_wait_for_work() -> None:
    clock = StepClock()
    assert clock.completed() == []
    clock.started(1.0, 12, 3)
    clock.finished(1.25)
    assert clock.completed() == [Step(0.25, 12, 3)]
    assert clock.completed() == [], "each step is timed once"
    clock.started(1.3, 0, 3)
    clock.finished(1.5)  # busy since the last tokens: the time between two steps' tokens
    assert clock.completed() == [Step(0.25, 0, 3)]
    clock.started(2.0, 0, 3)
    clock.stop()  # nothing left to run: the step is dropped, and the time to the next plan is a wait
    clock.finished(9.0)
    assert clock.completed() == []
    clock.started(9.0, 0, 0)  # an empty plan starts no step
    clock.finished(9.5)
    assert clock.completed() == []
    clock.started(10.0, 0, 2)
    clock.finished(10.5)  # timed from its own plan after a pause, not from the tokens before it
    assert clock.completed() == [Step(0.5, 0, 2)]


def test_a_step_timed_on_the_device_keeps_that_time() -> None:
    clock = StepClock()
    clock.started(1.0, 256, 4)
    clock.started(1.1, 0, 4)  # overlapped: the next step is planned before the first one's tokens are read
    clock.finished(1.4, 0.05)
    clock.finished(1.5, 0.01)
    first, second = clock.completed()
    assert (first.seconds, first.prompt_tokens, first.seqs, second.seconds) == (0.05, 256, 4, 0.01)
    # the host's intervals: from the first plan to its tokens, then between the two steps' tokens
    assert (first.wall_s, second.wall_s) == (pytest.approx(0.4), pytest.approx(0.1))
    assert first.interval_s == first.wall_s and Step(0.02, 0, 1).interval_s == 0.02


def test_overlapped_steps_keep_each_steps_time_with_the_step_that_spent_it() -> None:
    """With overlap the engine plans step k+1 before it reads step k's tokens. A GPU that takes 0.05 s for a
    prefill step and 0.01 s for a decode step: the decode-only steps are timed at 0.01 s, although the time from
    each decode step's plan to the next plan is the prefill's."""
    clock = StepClock()
    gpu_done = 0.0
    kinds = [(256, 0.05), (0, 0.01)] * 8
    plan_at = 0.0
    done: list[Step] = []
    for k, (prompt, _) in enumerate(kinds):
        clock.started(plan_at, prompt, 10)
        if k > 0:  # read the step before, launched one plan ago
            gpu_done += kinds[k - 1][1]
            clock.finished(gpu_done)
            plan_at = gpu_done  # the next plan comes once those tokens are read
        done += clock.completed()
    assert [s.prompt_tokens for s in done] == [256, 0] * 7 + [256]
    assert [s.seconds for s in done] == pytest.approx([0.05, 0.01] * 7 + [0.05])


def _busy_sim(settings: SloSettings, n: int = 60) -> Sim:
    """A backlogged queue (of requests with deadlines far off), stepped until the meter has an estimate."""
    sim = make_sim("fcfs", pages=200, max_num_seqs=2, settings=settings)
    for i in range(n):
        request = make_request(f"r{i}", BASE_TENANT, 8, 10, arrival=sim.clock.now)
        request.ttft_slo_s, request.ttft_deadline = 1e6, sim.clock.now + 1e6
        sim.add(request)
    while sim.scheduler.guard.meter.admitted_per_s() is None:
        sim.step()
    return sim


def test_requests_expected_to_miss_their_slo_are_refused_early() -> None:
    sim = _busy_sim(SloSettings())
    rate = sim.scheduler.guard.meter.admitted_per_s()
    assert rate is not None and 5 < rate < 50  # 2 seqs of 10 outputs each at 10 ms a step: about 18 per second
    depth = len(sim.scheduler.waiting)
    tight = make_request("tight", BASE_TENANT, 8, 4, arrival=sim.clock.now)
    tight.ttft_slo_s, tight.ttft_deadline = 0.5, sim.clock.now + 0.5  # behind `depth` requests: ~depth / rate s
    loose = make_request("loose", BASE_TENANT, 8, 4, arrival=sim.clock.now)
    loose.ttft_slo_s, loose.ttft_deadline = 100.0, sim.clock.now + 100.0
    assert depth / rate > 1.0
    sim.add(tight)
    sim.add(loose)
    plan = sim.step()
    refused = {r.request_id: e for r, e in plan.refused}
    assert set(refused) == {"tight"} and tight.finished and tight.finish_reason.value == "rejected"
    assert refused["tight"].reason == RefusalReason.TTFT_SLO_EARLY.value and "ttft_slo_s=0.5" in str(refused["tight"])
    assert sim.clock.now < tight.ttft_deadline, "refused before its deadline passed"
    assert sim.scheduler.refusals == {"ttft_slo_early": 1}
    sim.run()
    assert loose.num_output == 4 and kv_tokens(sim) == 0


def test_without_early_abort_only_passed_deadlines_refuse() -> None:
    sim = _busy_sim(SloSettings(early_abort=False))
    tight = make_request("tight", BASE_TENANT, 8, 4, arrival=sim.clock.now)
    tight.ttft_slo_s, tight.ttft_deadline = 0.5, sim.clock.now + 0.5
    sim.add(tight)
    while not tight.finished:
        sim.step()
    assert tight.finish_reason is not None and tight.finish_reason.value == "rejected"
    assert sim.scheduler.refusals == {"ttft_slo": 1} and sim.clock.now >= tight.ttft_deadline


def test_queue_timeout_refuses_requests_never_admitted() -> None:
    sim = make_sim("fcfs", pages=200, max_num_seqs=1, settings=SloSettings(queue_timeout_s=0.1))
    requests = [make_request(f"r{i}", BASE_TENANT, 4, 12, arrival=sim.clock.now) for i in range(4)]
    for r in requests:
        r.queue_deadline = r.arrival_time + 0.1
        sim.add(r)
    sim.run()
    assert [r.num_output for r in requests] == [12, 0, 0, 0]
    assert sim.scheduler.refusals == {"queue_timeout": 3} and kv_tokens(sim) == 0


def test_a_request_that_already_streamed_tokens_is_never_refused() -> None:
    """Preempted after its first tokens, it waits past its deadline: it is readmitted, not refused."""
    sim = make_sim("fcfs", pages=9, max_num_seqs=4)
    sim.add(make_request("big", BASE_TENANT, 20, 12, arrival=sim.clock.now))
    early = make_request("early", BASE_TENANT, 8, 20, arrival=sim.clock.now)
    early.ttft_slo_s, early.ttft_deadline = 0.05, sim.clock.now + 0.05
    sim.add(early)
    sim.run()
    assert early.num_preemptions > 0 and early.num_output == 20 and not sim.scheduler.refusals


# ---- engine level ----------------------------------------------------------------------------------------------


def _engine(model: ModelWithAdapters, pages: int = 400, **options: object) -> LLMEngine:
    case = schedule_trace.ScheduleCase("custom", seed=0, num_requests=0, pages=pages, options={})
    return schedule_trace.engine_for(case, model.base, model.adapter_root, **options)


def _golden() -> dict[str, list[str]]:
    return json.loads(schedule_trace.GOLDEN.read_text())


@pytest.mark.parametrize("case", schedule_trace.CASES, ids=lambda c: c.name)
def test_fcfs_schedules_exactly_as_before_policies(llama: ModelWithAdapters, case: schedule_trace.ScheduleCase) -> None:
    """The recorded schedules (tests/engine/data/fcfs_schedules.json, from the scheduler before policies existed):
    every step's seqs, chunk sizes and preemptions, with preemption, adapter eviction and overlapped steps."""
    engine = schedule_trace.engine_for(case, llama.base, llama.adapter_root, scheduling_policy="fcfs")
    assert schedule_trace.record(engine, case.arrivals(llama.adapters)) == _golden()[case.name]


@pytest.mark.parametrize("policy", ["fair", "priority"])
def test_preemption_and_eviction_keep_the_pool_whole(llama: ModelWithAdapters, policy: str) -> None:
    """A tight pool under each policy: preemptions and adapter evictions happen, the pool's integrity holds at every
    step (record() checks it), and every request's tokens are those of a roomy fcfs engine."""
    case = schedule_trace.CASES[0]
    arrivals = case.arrivals(llama.adapters)
    expected = _tokens_of(_engine(llama, pages=2000), arrivals)
    engine = schedule_trace.engine_for(case, llama.base, llama.adapter_root, scheduling_policy=policy,
                                       tenant_weights_file=None)  # fmt: skip
    tokens: dict[str, list[int]] = {}
    step = engine.step

    def keep() -> list[RequestOutput]:
        outputs = step()
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return outputs

    engine.step = keep  # type: ignore[method-assign]
    schedule_trace.record(engine, arrivals)
    assert engine.scheduler.num_preemptions > 0 and engine.cache.evictions > 0
    assert tokens == expected
    assert all(r.refcount == 0 for r in engine.cache.resident())


def _tokens_of(engine: LLMEngine, arrivals: list[schedule_trace.Arrival]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for a in arrivals:
        sampling = {"max_tokens": a.max_tokens, "temperature": 0.0, "ignore_eos": True}
        engine.add_request(a.prompt, a.adapter, sampling, request_id=a.request_id)
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_past_deadline_requests_are_refused_with_the_slo_named(llama: ModelWithAdapters) -> None:
    engine = _engine(llama, max_num_seqs=1)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = engine.add_request([5, 6, 7], "r3-all", greedy)
    late = [engine.add_request([8, 9], "r1-qv", greedy, tenant="acme", ttft_slo_s=0.001) for _ in range(3)]
    time.sleep(0.01)
    outputs: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    assert outputs[first].finish_reason == "length"
    for rid in late:
        out = outputs[rid]
        assert out.finished and out.finish_reason == "rejected" and out.new_token_ids == []
        assert isinstance(out.exception, SloRefusedError) and isinstance(out.exception, EngineOverloadedError)
        assert "ttft_slo_s=0.001" in (out.error or "") and out.exception.reason == "ttft_slo"
    stats = engine.stats()
    assert stats.refused_ttft_slo == 3 and stats.pages_kv == 0 and engine.pool.count(PageKind.KV) == 0
    engine.check_idle_integrity()
    assert all(r.refcount == 0 for r in engine.cache.resident())


def test_server_wide_slo_and_queue_timeout(llama: ModelWithAdapters) -> None:
    engine = _engine(llama, max_num_seqs=1, queue_timeout_s=0.002, ttft_slo_s=30.0)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request([5, 6, 7], None, greedy)]
    engine.step()  # admitted before its timeout
    ids += [engine.add_request([5, 6, 7], None, greedy) for _ in range(2)]
    time.sleep(0.01)
    reasons = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                reasons[out.request_id] = (out.finish_reason, out.error)
    assert reasons[ids[0]][0] == "length"
    assert all(reasons[i][0] == "rejected" and "queue_timeout_s=0.002" in reasons[i][1] for i in ids[1:])
    assert engine.stats().refused_queue_timeout == 2
    engine.check_idle_integrity()


def test_engine_loop_passes_the_new_fields_through(llama: ModelWithAdapters) -> None:
    from slora.backend.runtime.engine_service import LocalEngine
    from slora.backend.runtime.messages import Submission

    service = CallbackEngine(
        lambda sink: LocalEngine(_engine(llama, scheduling_policy="priority", max_num_seqs=1), sink)
    )
    finals: dict[str, RequestOutput] = {}
    done = threading.Event()

    def callback(out: RequestOutput) -> None:
        if out.finished:
            finals[out.request_id] = out
            if len(finals) == 3:
                done.set()

    sampling = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    try:
        service.submit(Submission("a", [5, 6], None, sampling, tenant="t1", priority=3), callback)
        service.submit(Submission("b", [5, 6], None, sampling, priority=1, ttft_slo_s=1e-9), callback)
        service.submit(Submission("c", [5, 6], None, sampling, tenant="bad/name"), callback)
        assert done.wait(60)
    finally:
        service.stop()
    assert finals["a"].finish_reason == "length"
    assert finals["b"].finish_reason == "rejected" and isinstance(finals["b"].exception, SloRefusedError)
    assert finals["c"].finish_reason == "rejected" and "tenant 'bad/name' is invalid" in (finals["c"].error or "")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("tenant", "", "tenant '' is invalid"),
        ("tenant", "../x", "tenant '../x' is invalid"),
        ("tenant", 7, "tenant 7 is invalid"),
        ("priority", 1.5, "priority must be an integer"),
        ("priority", True, "priority must be an integer"),
        ("priority", 10**9, "priority must be an integer"),
        ("ttft_slo_s", 0, "ttft_slo_s must be a finite number"),
        ("ttft_slo_s", -1.0, "ttft_slo_s must be"),
        ("ttft_slo_s", float("nan"), "ttft_slo_s must be"),
        ("ttft_slo_s", "6", "ttft_slo_s must be"),
    ],
)
def test_bad_request_fields_are_refused_naming_them(llama: ModelWithAdapters, field: str, value: object,
                                                    message: str) -> None:  # fmt: skip
    engine = _engine(llama)
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request([1, 2], None, None, **{field: value})  # type: ignore[arg-type]
    assert not engine.has_unfinished()


def test_tenant_weights_file_and_runtime_weights(llama: ModelWithAdapters, tmp_path: Path) -> None:
    good = tmp_path / "weights.json"
    good.write_text(json.dumps({"acme": 2, BASE_TENANT: 0.5}))
    engine = _engine(llama, scheduling_policy="fair", tenant_weights_file=str(good))
    assert engine.scheduler.book.weights == {"acme": 2.0, BASE_TENANT: 0.5}
    assert engine.set_tenant_weights({"globex": 3.0}) == {"acme": 2.0, BASE_TENANT: 0.5, "globex": 3.0}
    assert engine.set_tenant_weights({"acme": 1.5}, replace=True) == {"acme": 1.5}
    for bad, message in [({"acme": 0}, "weight of tenant 'acme'"), ({"acme": "2"}, "weight of tenant 'acme'"),
                         ({"acme": float("inf")}, "weight"), ({"a/b": 1.0}, "tenant 'a/b' is invalid")]:  # fmt: skip
        with pytest.raises(InvalidRequestError, match=message):
            engine.set_tenant_weights(bad)  # type: ignore[arg-type]
    assert engine.scheduler.book.weights == {"acme": 1.5}, "a refused change changes nothing"
    for text, message in [("[1, 2]", "must be an object"), ("{bad", "is not JSON"), ('{"x": -1}', "weight")]:
        good.write_text(text)
        with pytest.raises(ValueError, match=f"tenant_weights_file {re.escape(repr(str(good)))}.*{message}"):
            load_weights_file(good)
    with pytest.raises(ValueError, match="tenant_weights_file .* cannot be read"):
        load_weights_file(tmp_path / "missing.json")


def test_bad_config_values_name_the_field() -> None:
    for values, message in [
        ({"scheduling_policy": "lottery"}, "scheduling_policy"),
        ({"ttft_slo_s": 0}, "ttft_slo_s"),
        ({"ttft_slo_s": "nan"}, "ttft_slo_s"),
        ({"queue_timeout_s": -2}, "queue_timeout_s"),
        ({"priority_aging_rate": 0}, "priority_aging_rate"),
        ({"fair_output_cost": "inf"}, "fair_output_cost"),
        ({"tenant_stats_top": -1}, "tenant_stats_top"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig.from_dict(values)
    config = EngineConfig.from_dict({"scheduling_policy": "fair", "ttft_slo_s": "6", "early_abort": "false"})
    assert (config.scheduling_policy, config.ttft_slo_s, config.early_abort) == ("fair", 6.0, False)


def test_fair_without_itl_slo_s_warns_that_the_batch_is_not_capped(
    llama: ModelWithAdapters, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="slora.backend.engine.llm_engine"):
        _engine(llama, scheduling_policy="fair")
        _engine(llama, scheduling_policy="fair", itl_slo_s=0.05)
        _engine(llama, scheduling_policy="fcfs")
    warnings = [r.getMessage() for r in caplog.records if "without itl_slo_s" in r.getMessage()]
    assert len(warnings) == 1 and "scheduling_policy=fair" in warnings[0]


def test_stats_list_the_busiest_tenants_bounded(llama: ModelWithAdapters) -> None:
    engine = _engine(llama, scheduling_policy="fair", tenant_stats_top=2, max_num_seqs=2)
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for tenant, n in [("a", 1), ("b", 4), ("c", 2)]:
        for _ in range(n):
            engine.add_request([5, 6], None, greedy, tenant=tenant)
    engine.add_request([5, 6], "r1-qv", greedy)
    engine.step()
    stats = engine.stats()
    assert stats.scheduling_policy == "fair" and len(stats.tenants) == 2
    assert [t.tenant for t in stats.tenants] == ["b", "c"]
    assert all(t.counter is not None and t.waiting + t.running > 0 for t in stats.tenants)
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.book.usage["b"].output_tokens == 4 * 3
    assert engine.scheduler.book.usage["r1-qv"].prompt_tokens == 2, "an adapter's requests: its own tenant"


def test_slo_refusal_pickles_with_its_reason() -> None:
    error = pickle.loads(pickle.dumps(SloRefusedError("request 'x' refused: ttft_slo_s=1 s", "ttft_slo")))
    assert isinstance(error, EngineOverloadedError) and error.reason == "ttft_slo"
    assert str(error) == "request 'x' refused: ttft_slo_s=1 s"
