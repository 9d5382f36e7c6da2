"""`warmup=true`: synthetic batches at start (with host-resident adapters), then an idle, empty engine that
generates exactly what an engine without warm-up generates."""

from __future__ import annotations

import logging

import pytest
import torch

from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.executor.batch import ForwardBatch, ScheduledSeq
from slora.backend.executor.decode_batch import DecodeBatches
from slora.backend.memory.page_pool import PageKind
from slora.kernels.triton import lora_expand, lora_shrink
from tests.model_fixtures import ModelWithAdapters


def _engine(
    model: ModelWithAdapters, warmup: bool, max_batch_tokens: int = 48, overlap_steps: bool | None = None
) -> LLMEngine:
    config = EngineConfig(model=str(model.base), adapter_root=str(model.adapter_root), device="cpu", dtype="float32",
                          page_size=8, pool_bytes=16 << 20, max_num_seqs=12, max_batch_tokens=max_batch_tokens,
                          preload_adapters=True, warmup=warmup, overlap_steps=overlap_steps)  # fmt: skip
    return LLMEngine(config)


def test_warm_engine_is_idle_and_generates_as_a_cold_one(
    llama: ModelWithAdapters, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="slora.backend.engine.warmup"):
        warm = _engine(llama, warmup=True)
    assert f"warm-up: 5 waves of {1 + 8 + 8 + 12 + 12} requests" in caplog.text  # waves capped at max_num_seqs
    assert not warm.requests and not warm.scheduler.has_work()
    stats = warm.stats()  # the warm-up's requests are forgotten: a warm engine counts as a cold one
    assert (stats.generated_tokens, stats.finished_requests, stats.adapter_loads, stats.adapter_evictions) == (0,) * 4
    assert stats.preemptions == 0 and not stats.tenants and not warm.scheduler.book.usage
    assert warm.pool.count(PageKind.KV) == 0 and warm.pool.count(PageKind.ADAPTER) == 0
    cold = _engine(llama, warmup=False)
    prompts = [[5, 9, 14, 2, 7], [3] * 30, [11, 12]]
    adapters = [llama.adapters[0], None, llama.adapters[2]]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    warm_logits, cold_logits = _logits(warm, prompts, adapters, greedy), _logits(cold, prompts, adapters, greedy)
    assert len(warm_logits) == len(cold_logits)
    for got, want in zip(warm_logits, cold_logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    sampled = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)  # seeds drawn from the engine's seed
    assert [o.token_ids for o in _engine(llama, warmup=True).generate(prompts, adapters, sampled)] == [
        o.token_ids for o in _engine(llama, warmup=False).generate(prompts, adapters, sampled)
    ]


def _logits(engine: LLMEngine, prompts: list[list[int]], adapters: list, greedy: SamplingParams) -> list:  # type: ignore[type-arg]
    logits: list[torch.Tensor] = []
    engine.runner.logits_hook = lambda x: logits.append(x.detach().clone())
    engine.generate(prompts, adapters, greedy)
    return logits


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_warm_up_reaches_every_lora_tile_shape(
    llama: ModelWithAdapters, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """The warm-up's steps include each LoRA kernel config (decodes only, decodes with prompts, prompts only), so
    that on a GPU none of them compiles while serving (each compile is a stall of ~1 s on the H200 host); also
    with overlapped steps (the default on CUDA)."""
    seen = set()
    build = DecodeBatches.build

    def recording_build(
        self: DecodeBatches, seqs: list[ScheduledSeq], inflight: torch.Tensor | None = None
    ) -> ForwardBatch:
        batch = build(self, seqs, inflight)
        if batch.lora is not None:
            group = batch.lora.whole()
            for slices in (1, 3):  # one module (o, down) and fused ones (q, k, v)
                seen.add((lora_shrink.shrink_config(group, slices), lora_expand.expand_config(group, slices)))
        return batch

    monkeypatch.setattr(DecodeBatches, "build", recording_build)
    _engine(llama, warmup=True, max_batch_tokens=2048, overlap_steps=overlap)  # default budget: prompts fit a step
    kinds = {(lora_shrink.DECODE, lora_expand.DECODE), (lora_shrink.MIXED, lora_expand.MIXED)}
    kinds.add((lora_shrink.DECODE_ONE, lora_expand.DECODE_ONE))
    kinds.add((lora_shrink.PREFILL, lora_expand.PREFILL))
    assert seen == kinds


@pytest.mark.parametrize(
    ("pages", "max_waiting"), [(40, 256), (2000, 3), (6, 256)], ids=["small-pool", "short-queue", "no-adapter-fits"]
)
def test_warm_up_fits_a_small_pool_and_queue(
    llama: ModelWithAdapters, caplog: pytest.LogCaptureFixture, pages: int, max_waiting: int
) -> None:
    """A pool too small for the waves' longest prompts with the largest adapter, or a waiting queue shorter than a
    wave, gets a smaller warm-up, not a start that fails (CapacityError, EngineOverloadedError); an adapter that
    leaves no room for one token is left out of it."""
    probe = LLMEngine(EngineConfig(model=str(llama.base), device="cpu", dtype="float32", page_size=8))
    page_bytes = probe.pool.geometry.page_bytes(probe.dtype)
    config = EngineConfig(model=str(llama.base), adapter_root=str(llama.adapter_root), device="cpu", dtype="float32",
                          page_size=8, pool_bytes=pages * page_bytes, max_waiting=max_waiting, preload_adapters=True,
                          warmup=True)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="slora.backend.engine.warmup"):
        engine = LLMEngine(config)
    assert "warm-up: 5 waves" in caplog.text
    assert not engine.requests and not engine.scheduler.has_work()
    assert engine.pool.count(PageKind.KV) == 0 and engine.pool.count(PageKind.ADAPTER) == 0
    largest = max(engine.store.get(a).num_pages for a in llama.adapters)
    used = [a for a in llama.adapters if a in caplog.text.split("adapters ", 1)[1].split("]", 1)[0]]
    if pages <= largest:
        assert all(engine.store.get(a).num_pages < pages for a in used)
    out = engine.generate([[5, 9, 14]], [None], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
