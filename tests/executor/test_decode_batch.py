"""Decode batches built from the previous step's (executor/decode_batch.py) equal those build_batch makes afresh."""

from __future__ import annotations

import random

import pytest
import torch

from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.executor.batch import ForwardBatch, ScheduledSeq, build_batch
from tests.model_fixtures import ModelWithAdapters

LORA_FIELDS = ("token_adapter", "seg_start", "seg_adapter", "ranks", "scales", "row_start", "a_rows", "b_rows")
LORA_HOST = ("max_rank", "seg_start_host", "seg_adapter_host", "ranks_host", "scales_host", "row_start_host")


def _engine(model: ModelWithAdapters, page_size: int, overlap: bool = False) -> LLMEngine:
    config = EngineConfig(model=str(model.base), adapter_root=str(model.adapter_root), device="cpu", dtype="float32",
                          page_size=page_size, pool_bytes=8 << 20, max_num_seqs=16, max_batch_tokens=64,
                          overlap_steps=overlap)  # fmt: skip
    return LLMEngine(config)


def assert_same_batch(got: ForwardBatch, want: ForwardBatch, inputs: bool = True) -> None:
    """Equal batches; `inputs=False` skips the input tokens (with overlapped steps some are still in flight: a
    fresh build leaves them 0 for the runner to fill in)."""
    assert [s.request for s in got.seqs] == [s.request for s in want.seqs]
    assert [s.request for s in got.sampled] == [s.request for s in want.sampled]
    for name in ("input_ids", "positions", "sample_index")[0 if inputs else 1 :]:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in ("q_start", "seq_lens", "block_tables", "slot_mapping"):
        assert torch.equal(getattr(got.attn, name), getattr(want.attn, name)), name
    for name in ("max_q_len", "max_seq_len", "q_start_host", "seq_lens_host", "block_tables_host"):
        assert getattr(got.attn, name) == getattr(want.attn, name), name
    assert (got.lora is None) == (want.lora is None)
    if got.lora is not None and want.lora is not None:
        for name in LORA_FIELDS:
            assert torch.equal(getattr(got.lora, name), getattr(want.lora, name)), name
        for name in LORA_HOST:
            assert getattr(got.lora, name) == getattr(want.lora, name), name


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_decode_batches_equal_fresh_builds(llama: ModelWithAdapters, overlap: bool) -> None:
    """Requests of several adapters and the base model, arriving while others decode, with pages of 4 tokens (block
    tables grow every few steps): every step's batch equals build_batch's, and most decode steps are incremental;
    with overlapped steps an incremental batch's input tokens are the previous step's sampled tokens."""
    engine = _engine(llama, page_size=4, overlap=overlap)
    runner = engine.runner
    build = runner.batches.build
    checked = []

    def checking_build(seqs: list[ScheduledSeq], inflight: torch.Tensor | None = None) -> ForwardBatch:
        incremental = runner.batches.incremental
        got = build(seqs, inflight)
        want = build_batch(list(got.seqs), runner.pool.geometry.block_size, runner.device)
        assert_same_batch(got, want, inputs=inflight is None)
        if inflight is not None and runner.batches.incremental > incremental:
            assert got.input_ids is inflight
        checked.append(len(seqs))
        return got

    runner.batches.build = checking_build  # type: ignore[method-assign]
    rng = random.Random(7)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i in range(10):
        prompt = [rng.randrange(1, 100) for _ in range(rng.randint(3, 20))]
        engine.add_request(prompt, [None, *llama.adapters][i % (len(llama.adapters) + 1)], greedy)
        for _ in range(rng.randint(0, 3)):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    assert len(checked) > 20
    assert runner.batches.incremental > len(checked) // 3


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_decode_batches_give_the_same_tokens(llama: ModelWithAdapters, overlap: bool) -> None:
    """The engine's tokens with incremental decode batches equal those with every batch built afresh (with
    overlapped steps: the fresh builds' in-flight inputs filled in row by row)."""
    prompts = [[5, 9, 14, 2, 7], [3] * 11, [11, 12], [8, 1, 4]]
    adapters = [llama.adapters[0], None, llama.adapters[1], llama.adapters[0]]
    greedy = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    incremental = _engine(llama, page_size=4, overlap=overlap)
    got = incremental.generate(prompts, adapters, greedy)
    assert incremental.runner.batches.incremental > 0
    fresh = _engine(llama, page_size=4, overlap=overlap)
    fresh.runner.batches.build = lambda seqs, inflight=None: build_batch(  # type: ignore[method-assign]
        seqs, 4, fresh.runner.device
    )
    want = fresh.generate(prompts, adapters, greedy)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
