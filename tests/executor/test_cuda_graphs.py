"""Decode steps through the CUDA-graph buffers: padded static batches give the eager step's logits and tokens.

On CPU the static batches run eagerly (capture=False) with the interpreted Triton kernels, which checks the
padding, the null adapter and the static launch bounds; on CUDA the graphs are captured and replayed.
"""

from __future__ import annotations

import random

import pytest
import torch

from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.executor.cuda_graphs import DecodeGraphs, GraphLimits, bucket_sizes
from slora.backend.executor.graph_families import rank_bound
from slora.kernels.settings import KernelSettings
from slora.kernels.triton import lora_call
from tests.model_fixtures import ModelWithAdapters

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SETTINGS = KernelSettings()  # the engine's defaults


def test_rank_bounds_are_powers_of_two_within_the_limit() -> None:
    assert [rank_bound(r, 256) for r in (0, 1, 8, 16, 17, 64, 65, 256)] == [16, 16, 16, 16, 32, 64, 128, 256]
    assert rank_bound(100, 64) == 64


def test_bucket_sizes() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = bucket_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 32] and sizes[-1] == 256 and sizes == sorted(set(sizes))


def _engine(model: ModelWithAdapters, device: str, lora_fused: bool = False) -> LLMEngine:
    config = EngineConfig(model=str(model.base), adapter_root=str(model.adapter_root), device=device,
                          kernel_backend="triton", dtype="float32", page_size=8, pool_bytes=8 << 20,
                          max_num_seqs=12, max_model_len=64, max_lora_rank=16, lora_fused=lora_fused)  # fmt: skip
    return LLMEngine(config)


def _run(engine: LLMEngine, jobs: list[tuple[list[int], str | None]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    logits: list[torch.Tensor] = []
    engine.runner.logits_hook = lambda x: logits.append(x.detach().cpu().clone())
    results = engine.generate([p for p, _ in jobs], [a for _, a in jobs], GREEDY)
    engine.runner.logits_hook = None
    return [r.token_ids for r in results], logits


@pytest.mark.parametrize("device", ["cuda" if torch.cuda.is_available() else "cpu"])
def test_static_decode_batches_match_eager(llama: ModelWithAdapters, device: str) -> None:
    engine = _engine(llama, device)
    rng = random.Random(5)
    names: list[str | None] = [None, "r1-qv", "r3-all", "r16-all", "r8-mlp", None, "r12-qkv"]
    jobs = [([rng.randrange(150) for _ in range(rng.randint(3, 9))], names[i % len(names)]) for i in range(9)]
    eager_tokens, eager_logits = _run(engine, jobs)
    limits = GraphLimits(engine.config.max_num_seqs, engine.max_model_len, engine.config.max_lora_rank)
    graphs = DecodeGraphs(engine.model, engine.pool, limits, settings=SETTINGS, capture=device == "cuda")
    replays: list[int] = []
    forward = graphs.forward
    graphs.forward = lambda batch: replays.append(batch.num_tokens) or forward(batch)  # type: ignore[method-assign]
    engine.runner.graphs = graphs
    graph_tokens, graph_logits = _run(engine, jobs)
    assert len(replays) >= GREEDY.max_tokens - 1 and set(replays) - set(graphs.sizes), "padded buckets were used"
    assert graph_tokens == eager_tokens
    assert len(graph_logits) == len(eager_logits)
    for got, want in zip(graph_logits, eager_logits):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    engine.check_idle_integrity()


@pytest.mark.parametrize("device", ["cuda" if torch.cuda.is_available() else "cpu"])
def test_static_decode_batches_follow_changing_requests(llama: ModelWithAdapters, device: str) -> None:
    """Requests that finish at different steps while queued ones take their places: consecutive replays of one
    bucket see other requests and adapters (the static LoRA buffers must be refilled, and only then: a step of
    the same requests keeps them); tokens equal the eager engine's."""
    engine = _engine(llama, device)
    rng = random.Random(11)
    names: list[str | None] = ["r1-qv", "r3-all", None, "r16-all", "r12-qkv", "r8-mlp"]
    prompts = [[rng.randrange(150) for _ in range(rng.randint(3, 9))] for _ in range(15)]
    adapters = [names[i % len(names)] for i in range(15)]
    params = [SamplingParams(max_tokens=(3, 9)[i % 2], temperature=0.0, ignore_eos=True) for i in range(15)]
    eager = [c.token_ids for c in engine.generate(prompts, adapters, params)]
    limits = GraphLimits(engine.config.max_num_seqs, engine.max_model_len, engine.config.max_lora_rank)
    engine.runner.graphs = DecodeGraphs(engine.model, engine.pool, limits, settings=SETTINGS, capture=device == "cuda")
    assert [c.token_ids for c in engine.generate(prompts, adapters, params)] == eager
    assert engine.runner.batches.incremental > 0, "some decode steps ran the previous step's requests"
    engine.check_idle_integrity()


@pytest.mark.parametrize("device", ["cuda" if torch.cuda.is_available() else "cpu"])
def test_graphs_launch_the_lora_of_targeted_modules_only(
    llama: ModelWithAdapters, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attention-only adapters (S-LoRA's S1 kind): decode graphs are keyed by the targeted modules and launch no
    LoRA kernel for the MLP; tokens equal the eager engine's."""
    engine = _engine(llama, device)
    jobs = [([3, 14, 15, 92], "r1-qv"), ([6, 5, 35], "r12-qkv"), ([8, 9, 79, 3, 2], "r5-ko"), ([2, 7], None)]
    eager_tokens, _ = _run(engine, jobs)
    limits = GraphLimits(engine.config.max_num_seqs, engine.max_model_len, engine.config.max_lora_rank)
    graphs = DecodeGraphs(engine.model, engine.pool, limits, settings=SETTINGS, capture=device == "cuda")
    engine.runner.graphs = graphs
    launched: list[int] = []
    shrink = lora_call.shrink_launch
    monkeypatch.setattr(lora_call, "shrink_launch", lambda x, flat, meta, first, *rest, **kw: launched.append(first)
                        or shrink(x, flat, meta, first, *rest, **kw))  # fmt: skip
    graph_tokens, _ = _run(engine, jobs)
    assert graph_tokens == eager_tokens
    keys = set(graphs._static)  # noqa: SLF001 - which graphs the steps used
    assert any(key.modules == frozenset({0, 1, 2, 3}) and key.max_rank == 16 for key in keys), keys
    assert launched and not {4, 5, 6} & set(launched), sorted(set(launched))


@pytest.mark.parametrize("device", ["cuda" if torch.cuda.is_available() else "cpu"])
def test_decode_graphs_on_the_fused_lora_kernel(
    llama: ModelWithAdapters, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With lora_fused, decode graphs of many adapters launch the fused kernel over their static one-token tiles
    (padding rows of the null adapter add nothing); tokens and logits equal the eager engine's on the pair."""
    rng = random.Random(23)
    names: list[str | None] = ["r16-all", "r1-qv", "r3-all", None, "r8-mlp", "r12-qkv", "r3-all"]
    jobs = [([rng.randrange(150) for _ in range(rng.randint(3, 9))], names[i % len(names)]) for i in range(7)]
    eager_tokens, eager_logits = _run(_engine(llama, device), jobs)
    engine = _engine(llama, device, lora_fused=True)
    launched: list[int] = []  # the modules of the fused launches with a graph's static metadata
    fused_launch = lora_call.fused_launch
    monkeypatch.setattr(lora_call, "fused_launch", lambda *a, **kw: (a[3].static is not None and launched.append(a[4]))
                        or fused_launch(*a, **kw))  # fmt: skip
    limits = GraphLimits(engine.config.max_num_seqs, engine.max_model_len, engine.config.max_lora_rank)
    fused = engine.config.kernel_settings()
    engine.runner.graphs = DecodeGraphs(engine.model, engine.pool, limits, settings=fused, capture=device == "cuda")
    replays: list[int] = []
    forward = engine.runner.graphs.forward
    engine.runner.graphs.forward = lambda batch: replays.append(batch.num_tokens) or forward(batch)  # type: ignore[method-assign]
    graph_tokens, graph_logits = _run(engine, jobs)
    assert replays, "no decode step replayed a graph"
    assert graph_tokens == eager_tokens
    for got, want in zip(graph_logits, eager_logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert set(launched) == {0, 3, 4, 6}, sorted(set(launched))  # q/k/v, o, gate/up, down
    engine.check_idle_integrity()


@pytest.mark.parametrize("device", ["cuda" if torch.cuda.is_available() else "cpu"])
def test_steps_of_few_adapters_replay_tensor_core_graphs(llama: ModelWithAdapters, device: str) -> None:
    """Decode steps whose tokens belong to few adapters (KernelSettings.few_adapters, its token floor lowered to this
    engine's batches) replay graphs of 16-token tensor-core LoRA tiles; tokens and logits equal the eager engine's
    on the GEMV kernels, and steps of more adapters keep one-token tiles."""
    engine = _engine(llama, device)
    rng = random.Random(17)
    names = ["r16-all", "r3-all", "r16-all", None, "r3-all", "r16-all", "r3-all", "r16-all", None, "r12-qkv"]
    jobs = [([rng.randrange(150) for _ in range(rng.randint(3, 9))], name) for name in names]
    eager_tokens, eager_logits = _run(engine, jobs[:8])
    many_tokens, _ = _run(engine, jobs)
    few = KernelSettings(few_adapters_min_tokens=4, few_adapters_max=2)
    limits = GraphLimits(engine.config.max_num_seqs, engine.max_model_len, engine.config.max_lora_rank)
    graphs = DecodeGraphs(engine.model, engine.pool, limits, settings=few, capture=device == "cuda")
    engine.runner.graphs = graphs
    graph_tokens, graph_logits = _run(engine, jobs[:8])
    assert graph_tokens == eager_tokens
    for got, want in zip(graph_logits, eager_logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert {key.few for key in graphs._static if key.modules} == {True}  # noqa: SLF001 - the graphs the steps used
    graphs._static.clear()  # noqa: SLF001
    assert _run(engine, jobs)[0] == many_tokens  # three adapters
    assert not any(key.few for key in graphs._static), set(graphs._static)  # noqa: SLF001
    engine.check_idle_integrity()


@pytest.mark.parametrize("device", ["cuda" if torch.cuda.is_available() else "cpu"])
def test_steps_replay_the_family_of_the_host_adapters(llama: ModelWithAdapters, device: str) -> None:
    """After add_family (what the engine does for the adapters in host memory), steps whose adapters it covers
    replay its graphs instead of graphs of their own; tokens stay the eager engine's."""
    engine = _engine(llama, device)
    jobs = [([3, 14, 15, 92], "r1-qv"), ([6, 5, 35], "r12-qkv"), ([2, 7], "r1-qv"), ([8, 9, 79], None)]
    eager_tokens, _ = _run(engine, jobs)
    limits = GraphLimits(engine.config.max_num_seqs, engine.max_model_len, engine.config.max_lora_rank)
    graphs = DecodeGraphs(engine.model, engine.pool, limits, settings=SETTINGS, capture=device == "cuda")
    graphs.add_family(frozenset({0, 1, 2, 3}), 12)
    engine.runner.graphs = graphs
    graph_tokens, _ = _run(engine, jobs)
    assert graph_tokens == eager_tokens
    lora_keys = {key for key in graphs._static if key.modules}  # noqa: SLF001 - which graphs the steps used
    assert lora_keys and all(key.modules == frozenset({0, 1, 2, 3}) and key.max_rank == 16 for key in lora_keys)


@pytest.mark.parametrize("device", ["cuda" if torch.cuda.is_available() else "cpu"])
def test_every_bucket_writes_its_logits_into_one_buffer(llama: ModelWithAdapters, device: str) -> None:
    """Graphs keep no logits of their own (a float32 row of the vocabulary per bucket row of every family: gigabytes
    with Llama-3's): every decode step's logits are rows of one [max_num_seqs, vocab] buffer, whichever bucket and
    family it replays, and tokens stay the eager engine's."""
    engine = _engine(llama, device)
    rng = random.Random(23)
    names: list[str | None] = [None, "r1-qv", "r16-all", None, "r12-qkv"]
    prompts = [[rng.randrange(150) for _ in range(rng.randint(3, 9))] for _ in range(11)]
    adapters = [names[i % len(names)] for i in range(11)]
    params = [SamplingParams(max_tokens=2 + i % 5, temperature=0.0, ignore_eos=True) for i in range(11)]
    eager = [c.token_ids for c in engine.generate(prompts, adapters, params)]
    limits = GraphLimits(engine.config.max_num_seqs, engine.max_model_len, engine.config.max_lora_rank)
    graphs = DecodeGraphs(engine.model, engine.pool, limits, settings=SETTINGS, capture=device == "cuda")
    graphs.capture_all()
    outputs: list[torch.Tensor] = []
    forward = graphs.forward
    graphs.forward = lambda batch: outputs.append(forward(batch)) or outputs[-1]  # type: ignore[method-assign]
    engine.runner.graphs = graphs
    assert [c.token_ids for c in engine.generate(prompts, adapters, params)] == eager
    buffer = graphs.logits_buffer()
    assert buffer.shape == (engine.config.max_num_seqs, engine.spec.vocab_size) and buffer.dtype == torch.float32
    assert len({t.shape[0] for t in outputs}) > 1, "steps of several sizes"
    assert all(t.data_ptr() == buffer.data_ptr() for t in outputs)
    assert len({k.modules for k in graphs._static}) > 1, "several families"  # noqa: SLF001


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine captures graphs on CUDA only")
def test_the_engines_graphs_of_steps_with_prompts_share_the_decode_graphs_logits(llama: ModelWithAdapters) -> None:
    config = EngineConfig(model=str(llama.base), adapter_root=str(llama.adapter_root), device="cuda",
                          kernel_backend="triton", dtype="float32", page_size=8, pool_bytes=8 << 20,
                          max_num_seqs=12, max_model_len=64, max_lora_rank=16, cuda_graphs=True,
                          mixed_cuda_graphs=True, warmup=False)  # fmt: skip
    runner = LLMEngine(config).runner
    assert runner.graphs is not None and runner.mixed_graphs is not None
    assert runner.mixed_graphs.logits_buffer() is runner.graphs.logits_buffer()


def test_cuda_graphs_need_cuda_and_triton(llama: ModelWithAdapters) -> None:
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device and the triton kernel backend"):
        LLMEngine(EngineConfig(model=str(llama.base), device="cpu", cuda_graphs=True, pool_bytes=1 << 20))
