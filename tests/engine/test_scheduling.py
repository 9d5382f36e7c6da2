"""Continuous batching under pressure: preemption, adapter eviction, abort, capacity limits, integrity."""

from __future__ import annotations

import dataclasses
import random

import pytest

from slora.backend.config import AUTO_ADMIT_INTERVAL, EngineConfig, effective_admit_interval
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.errors import CapacityError
from slora.backend.memory.page_pool import PageKind
from tests.model_fixtures import ModelWithAdapters

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _engine(model: ModelWithAdapters, pages: int, target: dict[str, str] | None = None, **options: object) -> LLMEngine:
    config = EngineConfig(model=str(model.base), adapter_root=str(model.adapter_root), page_size=8,
                          **(target or {}), **options)  # type: ignore[arg-type]  # fmt: skip
    # the page size in bytes of the engine's own device and dtype, from a probe engine without adapters
    probe = LLMEngine(dataclasses.replace(config, adapter_root=None, pool_bytes=1 << 20, warmup=False))
    return LLMEngine(dataclasses.replace(config, pool_bytes=pages * probe.pool.geometry.page_bytes(probe.dtype)))


def _workload(model: ModelWithAdapters, n: int, seed: int) -> tuple[list[list[int]], list[str | None]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100) for _ in range(rng.randint(3, 14))] for _ in range(n)]
    adapters = [rng.choice([None, *model.adapters]) for _ in range(n)]
    return prompts, adapters


def _run_checked(engine: LLMEngine, prompts: list[list[int]], adapters: list[str | None]) -> dict[str, list[int]]:
    """Step to completion, checking the pool and the pins after every step."""
    ids = [engine.add_request(p, a, GREEDY) for p, a in zip(prompts, adapters)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        engine.pool.check_integrity()
        for request in engine.scheduler.running:
            if request.adapter is not None:
                assert request.resident is not None and request.resident.refcount > 0
    else:
        pytest.fail("the engine did not finish (deadlock?)")
    engine.check_idle_integrity()
    assert all(r.refcount == 0 for r in engine.cache.resident())
    return tokens


def test_pool_too_small_preempts_and_still_matches(llama: ModelWithAdapters, target: dict[str, str]) -> None:
    prompts, adapters = _workload(llama, 12, seed=1)
    roomy = _engine(llama, pages=2000, target=target)
    expected = roomy.generate(prompts, adapters, GREEDY)
    tight = _engine(llama, pages=80, target=target)
    got = _run_checked(tight, prompts, adapters)
    assert tight.scheduler.num_preemptions > 0, "the test should force preemption"
    assert tight.cache.evictions > 0, "the test should force adapter eviction"
    assert list(got.values()) == [c.token_ids for c in expected]


def test_adapter_larger_than_leftover_pages_waits_then_runs(llama: ModelWithAdapters) -> None:
    engine = _engine(llama, pages=50)
    big = engine.store.get("r16-all")
    assert big.num_pages > 25
    prompts, _ = _workload(llama, 6, seed=2)
    got = _run_checked(engine, prompts, ["r16-all", "r1-qv", "r16-all", "r12-qkv", None, "r16-all"])
    assert all(len(t) == GREEDY.max_tokens for t in got.values())


def test_abort_frees_pages_of_running_and_waiting(llama: ModelWithAdapters) -> None:
    engine = _engine(llama, pages=200, max_num_seqs=2)
    prompts, adapters = _workload(llama, 5, seed=3)
    ids = [engine.add_request(p, a, GREEDY) for p, a in zip(prompts, ["r3-all"] * 5)]
    engine.step()
    engine.step()
    assert len(engine.scheduler.running) == 2 and engine.pool.count(PageKind.KV) > 0
    for request_id in ids:
        out = engine.abort(request_id)
        assert out is not None and out.finished and out.finish_reason == "abort"
    assert engine.abort(ids[0]) is None
    assert not engine.has_unfinished()
    engine.check_idle_integrity()
    assert engine.pool.count(PageKind.KV) == 0
    assert all(r.refcount == 0 for r in engine.cache.resident())


def test_request_that_can_never_fit_is_refused(llama: ModelWithAdapters) -> None:
    engine = _engine(llama, pages=8)
    with pytest.raises(CapacityError, match="pages"):
        engine.add_request(list(range(20)), None, SamplingParams(max_tokens=60))
    assert not engine.has_unfinished()


def test_only_prefetch_uses_free_pages(llama: ModelWithAdapters) -> None:
    """Adapters of waiting requests are copied ahead into free pages, unpinned."""
    engine = _engine(llama, pages=400, max_num_seqs=1)
    prompts, _ = _workload(llama, 3, seed=4)
    for prompt, adapter in zip(prompts, ["r1-qv", "r5-ko", "r8-mlp"]):
        engine.add_request(prompt, adapter, GREEDY)
    engine.step()
    resident = {r.host.name: r.refcount for r in engine.cache.resident()}
    assert resident == {"r1-qv": 1, "r5-ko": 0, "r8-mlp": 0}


def test_admit_interval_admits_every_nth_step_while_others_decode(llama: ModelWithAdapters) -> None:
    """admit_interval=3: a request arriving while another decodes is admitted on the third step; an idle engine
    admits at once; every request's tokens are those of admitting on every step."""
    prompts, adapters = _workload(llama, 2, seed=5)
    expected = _engine(llama, pages=2000).generate(prompts, adapters, GREEDY)
    # Steps are counted: the late request's adapter is read at start and its admission never waits for a copy
    # (both timing-dependent, and on by default on CUDA), so only admit_interval holds it back.
    engine = _engine(llama, pages=2000, admit_interval=3, preload_adapters=True, admit_when_copied=False)
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    first = engine.add_request(prompts[0], adapters[0], GREEDY)
    step()  # an idle engine admits at once
    assert [r.request_id for r in engine.scheduler.running] == [first]
    late = engine.add_request(prompts[1], adapters[1], GREEDY)
    steps = 0
    while engine.scheduler.waiting:
        step()
        steps += 1
    assert steps == 3 and late in [r.request_id for r in engine.scheduler.running]
    while engine.has_unfinished():
        step()
    assert [tokens[first], tokens[late]] == [c.token_ids for c in expected]
    engine.check_idle_integrity()


def test_admit_interval_must_be_auto_or_positive() -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="admit_interval"):
            EngineConfig(admit_interval=bad)  # type: ignore[arg-type]


def test_admit_interval_auto_follows_cuda_graphs() -> None:
    """0 (the default) admits every AUTO_ADMIT_INTERVAL steps when decode steps are CUDA graphs, every step
    otherwise; a value given is kept."""
    assert effective_admit_interval(EngineConfig()) == 1
    graphs = EngineConfig(cuda_graphs=True)
    assert effective_admit_interval(graphs) == AUTO_ADMIT_INTERVAL == 2
    assert effective_admit_interval(dataclasses.replace(graphs, admit_interval=3)) == 3
