"""Tensor parallelism on the CPU (gloo, one worker process per rank beyond the first): greedy tokens of every
adapter and the base model, all in one batch, equal one device's and HF transformers + PEFT's; every rank's page
pool keeps rank 0's page table after every step; preemption and adapter eviction under a small pool change no
token; runtime adapter commands and statistics work as with one device."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.memory.page_pool import PoolGeometry
from slora.backend.model.spec import ModelSpec
from slora.backend.parallel.layout import ShardPlan
from slora.backend.parallel.startup import shard_geometry
from slora.backend.runtime.engine_service import LocalEngine
from slora.backend.runtime.messages import AdapterCommand
from tests.factories import hf_reference
from tests.model_fixtures import ModelWithAdapters
from tests.reference import compare_greedy, hf_greedy
from tests.runtime.callback_engine import CallbackEngine

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
CPU = {"device": "cpu", "kernel_backend": "torch", "dtype": "float32"}

_references: dict[tuple[str, str | None], Any] = {}  # HF models, loaded once per session


def _config(model: ModelWithAdapters, size: int, **options: object) -> EngineConfig:
    values: dict[str, Any] = {"model": str(model.base), "adapter_root": str(model.adapter_root),
                              "pool_bytes": 8 << 20, "page_size": 8, "tensor_parallel_size": size, **CPU}  # fmt: skip
    return EngineConfig(**{**values, **options})


@contextmanager
def _engine(config: EngineConfig) -> Iterator[LLMEngine]:
    engine = LLMEngine(config)
    try:
        yield engine
    finally:
        if engine.parallel is not None:
            engine.parallel.close()


def _jobs(model: ModelWithAdapters, lengths: list[int], seed: int) -> list[tuple[list[int], str | None]]:
    """Every adapter (ranks 1 to 64, odd ranks, MLP-only, rslora, rank_pattern) and the base model, two prompts each."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(160) for _ in range(n)] for n in lengths]
    names: list[str | None] = [None, *model.adapters]
    return [(prompts[(i + k) % len(prompts)], name) for i, name in enumerate(names) for k in range(2)]


def _run_checked(
    engine: LLMEngine, jobs: list[tuple[list[int], str | None]], sampling: SamplingParams = GREEDY
) -> list[list[int]]:
    """Step to the end, checking every rank's pool (and its page table against rank 0's) after every step."""
    assert engine.parallel is not None
    ids = [engine.add_request(p, a, sampling) for p, a in jobs]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        engine.parallel.check_integrity()
    engine.check_idle_integrity()
    return [tokens[i] for i in ids]


def _check_against_hf(model: ModelWithAdapters, jobs: list[tuple[list[int], str | None]], got: list[list[int]]) -> None:
    compared = 0
    for (prompt, adapter), tokens in zip(jobs, got):
        key = (str(model.base), adapter)
        if key not in _references:
            _references[key] = hf_reference(model.base, model.adapter_root / adapter if adapter else None)
        compared += compare_greedy(tokens, hf_greedy(_references[key], prompt, MAX_NEW), tie_margin=1e-4)
    assert compared >= 0.9 * MAX_NEW * len(jobs), f"only {compared} tokens were outside near ties"


def _equal_to_one_device_and_hf(model: ModelWithAdapters, size: int, lengths: list[int], **options: object) -> None:
    jobs = _jobs(model, lengths, seed=7)
    with _engine(_config(model, 1, **options)) as one:
        expected = [c.token_ids for c in one.generate([p for p, _ in jobs], [a for _, a in jobs], GREEDY)]
    with _engine(_config(model, size, **options)) as sharded:
        got = _run_checked(sharded, jobs)
    assert got == expected
    _check_against_hf(model, jobs, got)


def test_llama_gqa_two_ranks(llama_wide: ModelWithAdapters) -> None:
    """Two KV heads over two ranks; a small token budget chunks the prompts among other requests' decodes."""
    _equal_to_one_device_and_hf(llama_wide, 2, [5, 17, 9, 30], max_batch_tokens=40)


def test_llama_four_ranks_replicate_kv_heads(llama_wide: ModelWithAdapters) -> None:
    """Four ranks over two KV heads: each head (and its cache) on two ranks; ranks 1 to 64 split 4 ways."""
    _equal_to_one_device_and_hf(llama_wide, 4, [5, 17, 9])


def test_qwen2_two_ranks(qwen2_wide: ModelWithAdapters) -> None:
    """qkv bias, tied embeddings (one vocabulary shard for both), one KV head replicated on both ranks; with the
    GPU's defaults of overlapped steps (the input tokens broadcast while still being sampled) and admit_when_copied."""
    _equal_to_one_device_and_hf(qwen2_wide, 2, [6, 19, 12], overlap_steps=True, admit_when_copied=True)


def test_triton_kernels_two_ranks(llama: ModelWithAdapters) -> None:
    """The Triton shrink and expand kernels (interpreted on CPU) around the collectives give the same tokens."""
    jobs = [job for job in _jobs(llama, [5, 11], seed=3) if job[1] in (None, "r3-all", "r8-mlp", "r12-qkv")]
    with _engine(_config(llama, 1)) as one:
        expected = [c.token_ids for c in one.generate([p for p, _ in jobs], [a for _, a in jobs], GREEDY)]
    with _engine(_config(llama, 2, kernel_backend="triton")) as sharded:
        assert _run_checked(sharded, jobs) == expected


def _pool_bytes(model: ModelWithAdapters, size: int, pages: int) -> int:
    config = _config(model, size)
    geometry: PoolGeometry = shard_geometry(config, ShardPlan(ModelSpec.from_dir(model.base), size, 0))
    return pages * geometry.page_bytes(config.torch_dtype(config.torch_device()))


def test_preemption_and_eviction_under_a_small_pool(llama: ModelWithAdapters) -> None:
    """A pool too small for the workload preempts requests and evicts adapters on rank 0; every rank follows (and
    reads evicted adapters again): the tokens are those of a roomy single device."""
    rng = random.Random(1)
    jobs = [([rng.randrange(100) for _ in range(rng.randint(3, 14))], rng.choice([None, *llama.adapters]))
            for _ in range(12)]  # fmt: skip
    longer = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with _engine(_config(llama, 1, pool_bytes=64 << 20)) as roomy:
        expected = [c.token_ids for c in roomy.generate([p for p, _ in jobs], [a for _, a in jobs], longer)]
    with _engine(_config(llama, 2, pool_bytes=_pool_bytes(llama, 2, 80))) as tight:
        assert tight.pool.num_pages == 80
        got = _run_checked(tight, jobs, longer)
        assert tight.scheduler.num_preemptions > 0, "the test should force preemption"
        assert tight.cache.evictions > 0, "the test should force adapter eviction"
    assert got == expected


def test_adapter_commands_and_stats(llama: ModelWithAdapters, tmp_path: Any) -> None:
    """Admin load (under a new name), list and unload on rank 0 reach every rank: the new name serves its weights
    from every rank's pool; statistics count as on one device."""
    with _engine(_config(llama, 1)) as one:
        expected = one.generate([[5, 9, 14]], ["r5-ko"], GREEDY)[0].token_ids
    service = CallbackEngine(lambda sink: LocalEngine(LLMEngine(_config(llama, 2)), sink))
    try:
        assert len(service.info.worker_pids) == 1
        path = str(llama.adapter_root / "r5-ko")
        loaded = service.command(AdapterCommand("load", "renamed", path))
        assert loaded["adapters"][0]["rank"] == 5
        tokens = service.loop.call(lambda e: e.generate([[5, 9, 14]], ["renamed"], GREEDY)[0].token_ids)
        assert tokens == expected
        listed = {row["name"]: row for row in service.command(AdapterCommand("list"))["adapters"]}
        assert listed["renamed"]["state"] == "gpu"
        service.command(AdapterCommand("unload", "renamed"))
        service.loop.call(lambda e: e.check_idle_integrity())
        stats = service.loop.call(lambda e: e.stats())
        assert stats.generated_tokens == MAX_NEW and stats.adapters_gpu == 0 and stats.pages_kv == 0
    finally:
        service.stop()
    assert service.loop.engine.parallel is not None and service.loop.engine.parallel.failure is None


def test_a_size_the_model_cannot_split_fails_before_any_worker(llama: ModelWithAdapters) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's num_attention_heads"):
        LLMEngine(_config(llama, 3))
