"""The engine with a reserved adapter region (adapter_region_fraction, the "no unified memory" ablation): the same
tokens as the unified pool, less room under pressure (preemptions, adapter evictions, fewer running at once), and
requests or values that cannot work refused naming what is too small."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import pytest
import torch

from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.engine.startup import adapter_region_pages
from slora.backend.errors import CapacityError
from slora.backend.memory.page_pool import PageKind, PoolGeometry
from slora.backend.model.spec import ModelSpec
from tests.factories import hf_reference
from tests.model_fixtures import ModelWithAdapters
from tests.reference import compare_greedy, hf_greedy

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PAGE_SIZE = 8
SMALL_ADAPTERS = ("r1-qv", "r5-ko", "r2-down")  # 9 pages together at PAGE_SIZE


def _engine(model: ModelWithAdapters, pages: int, fraction: float | None, **options: object) -> LLMEngine:
    spec = ModelSpec.from_dir(model.base)
    page_bytes = PoolGeometry(spec.num_layers, PAGE_SIZE, spec.num_kv_heads, spec.head_dim).page_bytes(torch.float32)
    config = EngineConfig(model=str(model.base), adapter_root=str(model.adapter_root), page_size=PAGE_SIZE,
                          pool_bytes=pages * page_bytes, dtype="float32", device="cpu",
                          adapter_region_fraction=fraction, **options)  # type: ignore[arg-type]  # fmt: skip
    engine = LLMEngine(config)
    assert engine.pool.num_pages == pages
    return engine


def _workload(n: int, adapters: tuple[str | None, ...], seed: int) -> tuple[list[list[int]], list[str | None]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100) for _ in range(rng.randint(3, 14))] for _ in range(n)]
    return prompts, [adapters[i % len(adapters)] for i in range(n)]


@dataclass
class Run:
    tokens: list[list[int]]
    max_running: int  # requests running together, at most, over the run


def _run(engine: LLMEngine, prompts: list[list[int]], adapters: list[str | None]) -> Run:
    """Step to completion, checking the pool after every step."""
    ids = [engine.add_request(p, a, GREEDY) for p, a in zip(prompts, adapters)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    max_running = 0
    for _ in range(5000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        engine.pool.check_integrity()
        max_running = max(max_running, len(engine.scheduler.running))
    else:
        pytest.fail("the engine did not finish (deadlock?)")
    engine.check_idle_integrity()
    return Run([tokens[i] for i in ids], max_running)


def test_reserved_tokens_equal_unified_and_hf(llama: ModelWithAdapters) -> None:
    prompts, adapters = _workload(8, (None, *llama.adapters), seed=11)
    unified = _run(_engine(llama, 400, None), prompts, adapters)
    reserved_engine = _engine(llama, 400, 0.25)
    reserved = _run(reserved_engine, prompts, adapters)
    assert reserved.tokens == unified.tokens
    assert reserved_engine.stats().adapter_evictions == 0  # all 66 adapter pages fit the 100-page region
    for adapter in (None, "r3-all"):
        i = adapters.index(adapter)
        ref = hf_greedy(hf_reference(llama.base, llama.adapter_root / adapter if adapter else None), prompts[i], 24)
        assert compare_greedy(reserved.tokens[i], ref, tie_margin=1e-4) == GREEDY.max_tokens


def test_kv_pressure_preempts_in_reserved_mode_only(llama: ModelWithAdapters) -> None:
    """Twelve requests need up to 60 KV pages: the unified 100-page pool holds them with their adapters; a 40-page
    KV region does not, and evicting the (idle) adapters of the 60-page adapter region would not help it."""
    prompts, adapters = _workload(12, (None, *SMALL_ADAPTERS), seed=12)
    unified_engine, reserved_engine = _engine(llama, 100, None), _engine(llama, 100, 0.6)
    unified, reserved = _run(unified_engine, prompts, adapters), _run(reserved_engine, prompts, adapters)
    assert unified_engine.stats().preemptions == 0
    assert reserved_engine.stats().preemptions > 0
    assert reserved_engine.stats().adapter_evictions == 0
    assert reserved.tokens == unified.tokens


def test_adapter_pressure_evicts_in_reserved_mode_only(llama: ModelWithAdapters) -> None:
    """All seven adapters (66 pages) stay resident in the unified 200-page pool; a 40-page adapter region evicts
    them in turn and runs fewer requests at once (a request waits while its adapter finds no room)."""
    prompts, adapters = _workload(14, llama.adapters, seed=13)
    unified_engine, reserved_engine = _engine(llama, 200, None), _engine(llama, 200, 0.2)
    assert reserved_engine.pool.num_pages_for(PageKind.ADAPTER) == 40
    unified, reserved = _run(unified_engine, prompts, adapters), _run(reserved_engine, prompts, adapters)
    assert unified_engine.stats().adapter_evictions == 0
    assert reserved_engine.stats().adapter_evictions > 0
    assert reserved.max_running < unified.max_running
    assert reserved.tokens == unified.tokens
    reserved_engine.evict_adapters()
    assert reserved_engine.pool.count(PageKind.ADAPTER) == 0
    assert reserved_engine.pool.num_free_for(PageKind.ADAPTER) == 40


def test_adapter_larger_than_its_region_is_refused(llama: ModelWithAdapters) -> None:
    engine = _engine(llama, 100, 0.1)  # a 10-page adapter region
    with pytest.raises(CapacityError, match=r"adapter region has 10 .*adapter_region_fraction"):
        engine.add_request([1, 2, 3], "r16-all", GREEDY)  # 32 pages
    engine.add_request([1, 2, 3], "r1-qv", GREEDY)
    assert engine.has_unfinished()
    unified = _engine(llama, 100, None)
    unified.add_request([1, 2, 3], "r16-all", GREEDY)  # the same pool, unified, holds it


def test_kv_larger_than_its_region_is_refused(llama: ModelWithAdapters) -> None:
    engine = _engine(llama, 100, 0.9)  # a 10-page KV region: 80 tokens
    long = SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True)
    with pytest.raises(CapacityError, match=r"KV region has 10 .*adapter_region_fraction"):
        engine.add_request(list(range(20)), None, long)
    with pytest.raises(CapacityError, match="the pool has 40"):
        _engine(llama, 40, None).add_request(list(range(20)), None, SamplingParams(max_tokens=400))


def test_start_logs_the_split(llama: ModelWithAdapters, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="slora.backend.engine.startup"):
        _engine(llama, 100, 0.25)
    assert "pages [0, 25) adapter weights only, [25, 100) KV only" in caplog.text


@pytest.mark.parametrize("bad", [0, 0.0, 1, 1.0, 1.5, -0.25, float("nan"), float("inf"), True, "0.3"])
def test_bad_fraction_is_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(ValueError, match="adapter_region_fraction"):
        EngineConfig(adapter_region_fraction=bad)  # type: ignore[arg-type]


def test_fraction_parses_as_an_engine_option() -> None:
    assert EngineConfig.from_dict({"adapter_region_fraction": "0.25"}).adapter_region_fraction == 0.25
    assert EngineConfig.from_dict({"adapter_region_fraction": "none"}).adapter_region_fraction is None
    for text in ("quarter", "2"):
        with pytest.raises(ValueError, match="adapter_region_fraction"):
            EngineConfig.from_dict({"adapter_region_fraction": text})
    with pytest.raises(ValueError, match="adapter_region_fraction needs tensor_parallel_size 1"):
        EngineConfig(adapter_region_fraction=0.25, tensor_parallel_size=2)


def test_region_pages_leave_room_for_both_kinds() -> None:
    def pages(fraction: float | None, num_pages: int) -> int | None:
        return adapter_region_pages(EngineConfig(adapter_region_fraction=fraction), num_pages)

    assert pages(None, 10) is None
    assert (pages(0.25, 100), pages(0.001, 10), pages(0.999, 10)) == (25, 1, 9)
    with pytest.raises(ValueError, match="adapter_region_fraction"):
        pages(0.5, 1)
