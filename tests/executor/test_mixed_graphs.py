"""Steps with prompts through the CUDA-graph buffers: padded static batches give the eager step's logits and tokens.

On CPU the static batches run eagerly (capture=False) with the interpreted Triton kernels, which checks the
padding (token rows, sequences, sampled rows), the null sequence of the attention tiles, the null adapter and the
static launch bounds; on CUDA the graphs are captured and replayed.
"""

from __future__ import annotations

import random

import pytest
import torch

from slora.backend.config import EngineConfig
from slora.backend.engine.defaults import AUTO_MIXED_GRAPH_TOKENS, mixed_graph_tokens_rule, mixed_graphs_rule
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.executor.cuda_graphs import bucket_for
from slora.backend.executor.graph_families import NO_MODULES
from slora.backend.executor.mixed_graphs import (
    MixedBuffers,
    MixedGraphs,
    MixedKey,
    MixedLimits,
    TileShapes,
    seq_buckets,
    token_buckets,
)
from slora.kernels.metadata import SHORT_SEGMENT
from tests.model_fixtures import ModelWithAdapters

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def test_buckets() -> None:
    assert token_buckets(1024) == [16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024]
    assert token_buckets(40) == [16, 32, 40]
    assert token_buckets(16) == [16]
    assert seq_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert seq_buckets(12) == [12]
    assert seq_buckets(100) == [16, 32, 64, 100]


def _graphs(engine: LLMEngine, capture: bool) -> MixedGraphs:
    c = engine.config
    assert c.max_batch_tokens is not None and c.max_num_seqs is not None
    limits = MixedLimits(c.max_batch_tokens, c.max_num_seqs, engine.max_model_len, c.max_lora_rank)
    settings = engine.config.kernel_settings()
    return MixedGraphs(engine.model, engine.pool, limits, row_align=1, settings=settings, capture=capture)


def test_keys_cover_every_step_shape(llama: ModelWithAdapters) -> None:
    """Every (tokens, sequences) a step can have (no more sequences than tokens) has a key among those captured at
    start, largest first."""
    engine = _engine(llama, DEVICE, max_batch_tokens=300, max_num_seqs=40)
    graphs = _graphs(engine, capture=False)
    keys = graphs.keys(NO_MODULES, 0)
    assert keys[0] == MixedKey(300, 40, NO_MODULES, 0) and len(keys) == len(set(keys))
    assert [k.tokens for k in keys] == sorted((k.tokens for k in keys), reverse=True)
    for tokens in range(1, 301):
        for seqs in range(1, min(tokens, 40) + 1):
            key = MixedKey(bucket_for(graphs.token_sizes, tokens), bucket_for(graphs.seq_sizes, seqs), NO_MODULES, 0)
            assert key in keys, (tokens, seqs)


def test_split_graphs_have_a_variant_for_steps_of_few_adapters(llama: ModelWithAdapters) -> None:
    """With graph_lora_split, every LoRA bucket of at least few_adapters_min_tokens tokens also gets a graph for
    steps of few adapters; buckets without LoRA and graphs without the split do not."""
    engine = _engine(llama, DEVICE, max_batch_tokens=300, max_num_seqs=40, graph_lora_split=True)
    graphs = _graphs(engine, capture=False)
    keys = graphs.keys(frozenset({0, 1}), 8)
    plain = [key for key in keys if not key.few]
    few = {key._replace(few=False) for key in keys if key.few}
    assert plain == [key._replace(modules=frozenset({0, 1}), max_rank=8) for key in graphs.keys(NO_MODULES, 0)]
    assert few == {key for key in plain if key.tokens >= engine.config.few_adapters_min_tokens} and few
    assert not any(key.few for key in graphs.keys(NO_MODULES, 0))
    pair = _graphs(_engine(llama, DEVICE, max_batch_tokens=300, max_num_seqs=40), capture=False)
    assert not any(key.few for key in pair.keys(frozenset({0, 1}), 8))


def test_attention_tiles_of_a_step() -> None:
    """Short sequences (decodes, short chunks) get one short tile each, prompts tiles of the long group's size;
    the rest of each buffer names the null sequence; a step of more tiles than its graph holds is refused."""
    shapes = TileShapes(short=16, long=64)
    buffers = MixedBuffers.__new__(MixedBuffers)  # the host-side tiling only: no device buffers
    buffers.shapes, buffers.null = shapes, 9
    q_start = [0, 1, 2, 150, 151, 167, 200]  # decode, decode, prompt of 148, decode, chunk of 16, chunk of 33
    short, long = buffers.tiles(q_start, MixedKey(256, 8, NO_MODULES, 0))
    assert short.tolist() == [[0, 0, 1, 0], [1, 1, 2, 1], [3, 150, 151, 3], [4, 151, 167, 4]] + [[9, 0, 0, 9]] * 4
    rows = shapes.long_tiles(256, 8)
    assert rows == 4 + 8
    assert long.tolist() == [[2, 2, 150, 2], [2, 66, 150, 2], [2, 130, 150, 2], [5, 167, 200, 5]] + [[9, 0, 0, 9]] * (
        rows - 4
    )
    assert short.dtype == long.dtype == torch.int32
    with pytest.raises(ValueError, match="does not fit the graph"):
        buffers.tiles([0, *range(1, 10)], MixedKey(16, 8, NO_MODULES, 0))


def test_prompt_tiles_never_exceed_the_bound() -> None:
    """long_tiles bounds the prompt tiles of any split of a bucket's tokens into sequences."""
    shapes = TileShapes(short=16, long=64)
    rng = random.Random(3)
    for _ in range(300):
        tokens, seqs = rng.choice([(256, 16), (512, 64), (2048, 512), (64, 64)])
        lengths = [rng.choice([1, 1, 17, 64, 65, rng.randrange(1, 400)]) for _ in range(seqs)]
        while sum(lengths) > tokens:
            lengths.pop()
        needed = sum(-(-n // shapes.long) for n in lengths if n > SHORT_SEGMENT)
        assert needed <= shapes.long_tiles(tokens, seqs)


def _engine(model: ModelWithAdapters, device: str, **options: int | bool) -> LLMEngine:
    values = dict(page_size=8, pool_bytes=8 << 20, max_num_seqs=12, max_batch_tokens=40, max_model_len=128,
                  max_lora_rank=16)  # fmt: skip
    values.update(options)
    config = EngineConfig(model=str(model.base), adapter_root=str(model.adapter_root), device=device,
                          kernel_backend="triton", dtype="float32", cuda_graphs=False, **values)  # type: ignore[arg-type]  # fmt: skip
    return LLMEngine(config)


def _run(
    engine: LLMEngine, prompts: list[list[int]], adapters: list[str | None], params: list[SamplingParams]
) -> tuple[list[list[int]], list[torch.Tensor]]:
    logits: list[torch.Tensor] = []
    engine.runner.logits_hook = lambda x: logits.append(x.detach().cpu().clone())
    results = engine.generate(prompts, adapters, params)
    engine.runner.logits_hook = None
    return [r.token_ids for r in results], logits


def _jobs(seed: int, count: int) -> tuple[list[list[int]], list[str | None], list[SamplingParams]]:
    rng = random.Random(seed)
    names: list[str | None] = [None, "r1-qv", "r3-all", "r16-all", "r8-mlp", None, "r12-qkv", "r5-ko"]
    prompts = [[rng.randrange(150) for _ in range(rng.choice([3, 9, 20, 37, 70]))] for _ in range(count)]
    params = [SamplingParams(max_tokens=rng.choice([2, 5, 8]), temperature=0.0, ignore_eos=True) for _ in prompts]
    return prompts, [names[i % len(names)] for i in range(count)], params


@pytest.mark.parametrize("device", [DEVICE])
@pytest.mark.parametrize("graph_lora_split", [False, True])
def test_static_mixed_batches_match_eager(llama: ModelWithAdapters, device: str, graph_lora_split: bool) -> None:
    """Prompts of 3-70 tokens in chunks of a 40-token budget beside decodes of other requests, with and without
    adapters of every kind: every step with prompts runs through the padded buffers, and tokens and logits equal
    the eager engine's, also in steps of as many sequences as the buffers hold (the null sequence then reads the last
    one's end); the pool's pages all come back. The graphs' LoRA runs in one launch group (the default) or in two
    (graph_lora_split: short segments on the GEMV kernels, long ones on prompt tiles; a step of few adapters in its
    own graph of prompt tiles alone)."""
    engine = _engine(llama, device, max_num_seqs=5, graph_lora_split=graph_lora_split)
    prompts, adapters, params = _jobs(seed=5, count=10)
    eager_tokens, eager_logits = _run(engine, prompts, adapters, params)
    eager = engine.stats()
    graphs = _graphs(engine, capture=device == "cuda")
    shapes: list[tuple[int, int]] = []
    forward = graphs.forward
    graphs.forward = lambda batch: shapes.append((batch.num_tokens, batch.attn.num_seqs)) or forward(batch)  # type: ignore[method-assign]
    engine.runner.mixed_graphs = graphs
    graph_tokens, graph_logits = _run(engine, prompts, adapters, params)
    assert graph_tokens == eager_tokens
    stats = engine.stats()  # every forward through the buffers counts as a graph step (slora_step_graphs_total)
    assert eager.step_graphs_decode == eager.step_graphs_prompt == 0
    assert stats.step_graphs_decode + stats.step_graphs_prompt == len(shapes) and stats.step_graphs_prompt > 0
    assert len(graph_logits) == len(eager_logits)
    for got, want in zip(graph_logits, eager_logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert len(shapes) >= 6, shapes
    assert any(tokens not in graphs.token_sizes for tokens, _ in shapes), "padded token buckets were used"
    assert any(seqs > 1 for _, seqs in shapes), "steps with several sequences ran"
    assert any(seqs == graphs.seq_sizes[-1] for _, seqs in shapes), "a step filled the largest sequence bucket"
    keys = set(graphs._static)  # noqa: SLF001 - which graphs the steps used
    assert any(key.modules for key in keys) and any(not key.modules for key in keys), keys
    for key in keys:
        lora = graphs._static[key].batch.lora  # noqa: SLF001 - the graph's LoRA launch groups
        assert (lora is not None) == bool(key.modules)
        assert not key.few or graph_lora_split
        if lora is not None:
            want = (["prompts"] if key.few else ["short", "prompts"]) if graph_lora_split else ["mixed"]
            assert [g.kind(engine.config.kernel_settings()) for g in lora.groups(split=True)] == want, key
    if graph_lora_split:  # steps of few adapters (32 adapter tokens over at most 8) and of more
        assert {key.few for key in keys if key.modules} == {False, True}, keys
    engine.check_idle_integrity()


@pytest.mark.parametrize("device", [DEVICE])
def test_steps_with_prompts_replay_the_family_of_the_host_adapters(llama: ModelWithAdapters, device: str) -> None:
    """After add_family, steps of attention-only adapters replay that family's graphs (no MLP LoRA launched) and
    consecutive steps of one bucket see other requests; tokens equal the eager engine's."""
    engine = _engine(llama, device)
    rng = random.Random(23)
    prompts = [[rng.randrange(150) for _ in range(rng.choice([4, 18, 30]))] for _ in range(10)]
    adapters: list[str | None] = [("r1-qv", "r12-qkv", "r5-ko", None)[i % 4] for i in range(10)]
    params = [SamplingParams(max_tokens=(3, 6)[i % 2], temperature=0.0, ignore_eos=True) for i in range(10)]
    eager_tokens, _ = _run(engine, prompts, adapters, params)
    graphs = _graphs(engine, capture=device == "cuda")
    graphs.add_family(frozenset({0, 1, 2, 3}), 12)
    engine.runner.mixed_graphs = graphs
    graph_tokens, _ = _run(engine, prompts, adapters, params)
    assert graph_tokens == eager_tokens
    lora_keys = {key for key in graphs._static if key.modules}  # noqa: SLF001 - which graphs the steps used
    assert lora_keys and all(key.modules == frozenset({0, 1, 2, 3}) and key.max_rank == 16 for key in lora_keys)


def test_mixed_graphs_option() -> None:
    """auto follows cuda_graphs; on without CUDA graphs is refused, naming both options."""
    auto = EngineConfig()
    assert mixed_graphs_rule(auto, cuda_graphs=True).value is True
    assert mixed_graphs_rule(auto, cuda_graphs=False).value is False
    assert mixed_graphs_rule(EngineConfig(mixed_cuda_graphs=False), cuda_graphs=True).value is False
    with pytest.raises(ValueError, match="mixed_cuda_graphs=true needs cuda_graphs"):
        mixed_graphs_rule(EngineConfig(mixed_cuda_graphs=True), cuda_graphs=False)
    with pytest.raises(ValueError, match="mixed_cuda_graphs needs cuda_graphs"):
        EngineConfig(mixed_cuda_graphs=True, cuda_graphs=False)
    assert EngineConfig.from_dict({"mixed_cuda_graphs": "auto"}).mixed_cuda_graphs is None
    assert mixed_graph_tokens_rule(auto, 4096).value == AUTO_MIXED_GRAPH_TOKENS
    assert mixed_graph_tokens_rule(auto, 40).value == 40
    assert mixed_graph_tokens_rule(EngineConfig(mixed_cuda_graph_tokens=300), 2048).value == 300
    with pytest.raises(ValueError, match="mixed_cuda_graph_tokens must be a positive integer"):
        EngineConfig(mixed_cuda_graph_tokens=0)
