"""Heterogeneous LoRA (Triton shrink + expand, and the padded-bmm baseline) against the plain-torch reference.

Every case runs the four LoRA calls of one decoder layer (q/k/v fused, o, gate/up fused, down) on a step that
mixes adapters of different ranks and targets with base-model tokens, over a pool whose pages are scrambled.
Rows of base tokens, and columns of modules a token's adapter does not target, must come back bit-identical.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from slora.backend.adapters.host_adapter import load_peft_adapter  # noqa: E402
from slora.backend.config import EngineConfig  # noqa: E402
from slora.backend.executor import static_lora  # noqa: E402
from slora.backend.memory.page_pool import PoolGeometry  # noqa: E402
from slora.kernels.metadata import LoraMeta, SegmentGroup, length_groups  # noqa: E402
from slora.kernels.reference.lora import lora_ref  # noqa: E402
from slora.kernels.reference.lora_padded import lora_padded_bmm  # noqa: E402
from slora.kernels.settings import KernelSettings  # noqa: E402
from slora.kernels.triton import lora_call, lora_expand, lora_shrink  # noqa: E402
from slora.kernels.triton.lora_call import consecutive_runs  # noqa: E402
from slora.kernels.triton.ops import TritonOps  # noqa: E402
from slora.kernels.triton.relaunch import Relaunch  # noqa: E402
from tests.kernels.builders import (  # noqa: E402
    DEVICE,
    DOWN,
    FULL_SHAPES,
    GATE,
    TINY,
    UP,
    K,
    O,
    Q,
    Shape,
    V,
    adapter_pages,
    assert_close,
    gpu_only,
    lora_step,
    make_adapter,
    make_resident,
    model_spec,
    module_widths,
    scrambled_pool,
)

ALL = (1, 1, 1, 1, 1, 1, 1)

# (ranks per module) of the small CPU adapters: ranks 1 to 128, partial targets, a gap inside the fused q/k/v.
TINY_ADAPTERS = (
    (1, 0, 1, 0, 0, 0, 0),
    tuple(3 * t for t in ALL),
    (0, 0, 0, 0, 8, 8, 8),
    (0, 16, 0, 16, 0, 0, 0),
    tuple(64 * t for t in ALL),
    (128, 3, 1, 0, 16, 8, 64),
)

# Steps on TINY_ADAPTERS as (adapter index or None for the base model, tokens) per request.
TINY_STEPS = {
    "decode": [(0, 1), (None, 1), (1, 1), (5, 1), (1, 1), (2, 1), (3, 1), (None, 1), (4, 1), (1, 1)],
    "prefill": [(None, 5), (4, 70), (0, 7), (5, 3)],
    "mixed": [(2, 20), (0, 1), (None, 3), (5, 1), (3, 1), (4, 17)],
}

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SETTINGS = KernelSettings()  # the engine's defaults


@dataclass
class LayerCase:
    shape: Shape
    dtype: torch.dtype
    flat_layer: torch.Tensor
    meta: LoraMeta
    num_tokens: int


def layer_calls(shape: Shape) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]]:
    """(modules, out_offsets, out_widths, in_features) of the four LoRA calls of model.py's layer."""
    w = module_widths(shape)
    q, kv, inter, hidden = w[Q][1], w[K][1], shape.intermediate, shape.hidden
    return [
        ((Q, K, V), (0, q, q + kv), (q, kv, kv), hidden),
        ((O,), (0,), (hidden,), w[O][0]),
        ((GATE, UP), (0, inter), (inter, inter), hidden),
        ((DOWN,), (0,), (hidden,), inter),
    ]


def build_case(
    shape: Shape,
    dtype: torch.dtype,
    adapter_ranks: list[tuple[int, ...]],
    step: list[tuple[int | None, int]],
    seed: int,
    block_size: int = 16,
    low_pages: int = 0,
) -> LayerCase:
    geometry = PoolGeometry(num_layers=1, block_size=block_size, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim)
    hosts = [make_adapter(f"a{i}", r, shape, geometry, dtype, seed + i) for i, r in enumerate(adapter_ranks)]
    # The low pages stay busy, so that adapters live at high pool offsets.
    pool = scrambled_pool(geometry, low_pages + adapter_pages(hosts) + 7, dtype, seed, low=low_pages)
    residents = make_resident(pool, hosts)
    meta, _ = lora_step([None if a is None else residents[a] for a, _ in step], [n for _, n in step])
    return LayerCase(shape, dtype, pool.flat_layer(0), meta, sum(n for _, n in step))


def untouched(case: LayerCase, modules: tuple[int, ...], offsets: tuple[int, ...], widths: tuple[int, ...]):  # type: ignore[no-untyped-def]
    """Bool [num_tokens, columns]: where y must keep its value (base tokens, modules the adapter lacks)."""
    keep = torch.ones((case.num_tokens, sum(widths)), dtype=torch.bool)
    meta = case.meta
    for g, a in enumerate(meta.seg_adapter_host):
        start, end = meta.seg_start_host[g], meta.seg_start_host[g + 1]
        for m, offset, width in zip(modules, offsets, widths):
            if meta.ranks_host[a][m]:
                keep[start:end, offset : offset + width] = False
    return keep.to(DEVICE)


def check_layer(
    case: LayerCase, impl: str | Callable[..., None], seed: int, settings: KernelSettings = SETTINGS
) -> None:
    """Each of the layer's LoRA calls through `impl` ("triton", "bmm", or a function with TritonOps.lora's
    arguments) against the torch reference."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    run = {"triton": TritonOps(settings).lora, "bmm": lora_padded_bmm}[impl] if isinstance(impl, str) else impl
    for modules, offsets, widths, in_features in layer_calls(case.shape):
        x = torch.randn((case.num_tokens, in_features), generator=gen, device=DEVICE).to(case.dtype)
        y0 = torch.randn((case.num_tokens, sum(widths)), generator=gen, device=DEVICE).to(case.dtype)
        expected = y0.clone()
        lora_ref(expected, x, case.flat_layer, case.meta, modules, offsets, widths)
        actual = y0.clone()
        run(actual, x, case.flat_layer, case.meta, modules, offsets, widths)
        magnitude = float((expected.float() - y0.float()).abs().max())
        assert magnitude > 0, f"modules {modules}: the step adds no LoRA delta (a broken test case)"
        assert_close(actual, expected, case.dtype, magnitude)
        keep = untouched(case, modules, offsets, widths)
        assert torch.equal(actual[keep], y0[keep]), f"modules {modules}: y changed where no adapter applies"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("step", sorted(TINY_STEPS))
def test_lora_matches_reference(step: str, dtype: torch.dtype) -> None:
    case = build_case(TINY, dtype, list(TINY_ADAPTERS), TINY_STEPS[step], seed=3)
    check_layer(case, "triton", seed=4)


def test_lora_launches_are_reused_by_every_layer() -> None:
    """The launches built by a step's first layer serve its later layers with new x, y (on CUDA straight to the
    compiled kernels): each layer still gets its own inputs' delta."""
    case = build_case(TINY, torch.bfloat16, list(TINY_ADAPTERS), TINY_STEPS["mixed"], seed=23)
    check_layer(case, "triton", seed=24)
    built = dict(case.meta.launches)
    assert len(built) == 4, "one entry per call site of the layer"
    check_layer(case, "triton", seed=25)
    assert case.meta.launches == built, "the second layer built no launch of its own"


@pytest.mark.parametrize("step", sorted(TINY_STEPS))
def test_lora_split_k(step: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Input features split across programs (as on real widths), partial sums merged by the expand kernel (GEMV) or
    by the shrink's last split (tensor cores); a second layer reuses the launches, whose split counters must be back
    at zero."""
    for name in ("DECODE", "DECODE_ONE", "MIXED", "PREFILL"):
        config = getattr(lora_shrink, name)
        monkeypatch.setattr(lora_shrink, name, dataclasses.replace(config, block_k=16, target_programs=4096))
    case = build_case(TINY, torch.bfloat16, list(TINY_ADAPTERS), TINY_STEPS[step], seed=19)
    check_layer(case, "triton", seed=20)
    check_layer(case, "triton", seed=21)


@pytest.mark.parametrize("few_adapters", [None, 8])
def test_lora_of_a_split_graph(few_adapters: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step with decodes and prompts through a graph's static split groups (executor/static_lora.py): its short
    segments on the GEMV kernels a tile each, its long ones on prompt tiles whose K split is planned for fewer tiles
    than the buffer holds; or, as a graph for steps of few adapters, all on prompt tiles. K is split as on real
    widths. Every call matches the reference of the step's own metadata."""
    for name in ("DECODE", "DECODE_ONE", "MIXED", "PREFILL"):
        config = getattr(lora_shrink, name)
        monkeypatch.setattr(lora_shrink, name, dataclasses.replace(config, block_k=16, target_programs=4096))
    case = build_case(TINY, torch.float32, list(TINY_ADAPTERS), TINY_STEPS["mixed"], seed=31)
    seqs = len(TINY_STEPS["mixed"])
    tiling = static_lora.mixed_tiling(case.num_tokens, seqs, split=True, few_adapters=few_adapters)
    meta = case.meta
    static = static_lora.StaticLora(case.num_tokens, seqs, meta.targeted_modules(), meta.max_rank, meta.row_align,
                                    meta.token_adapter.device, tiling)  # fmt: skip
    static.fill(meta, case.num_tokens)
    kinds = [g.kind(SETTINGS) for g in static.meta.groups(split=True)]
    assert kinds == (["prompts"] if few_adapters else ["short", "prompts"])
    ops = TritonOps(SETTINGS)

    def through_graph(y, x, flat_layer, _meta, modules, offsets, widths):  # type: ignore[no-untyped-def]
        ops.lora(y, x, flat_layer, static.meta, modules, offsets, widths)

    check_layer(case, through_graph, seed=32)


def test_split_and_unsplit_steps_share_compiled_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of many tiles (K unsplit) and one of few (K split, summed by the shrink's last split) launch the same
    constexprs: one compiled variant serves both, so a server warmed up on either compiles nothing for the other
    (a constexpr for the split made the H200's engine runs compile inside their clocks, RESULTS.md session 14)."""
    monkeypatch.setattr(lora_shrink, "MIXED", dataclasses.replace(lora_shrink.MIXED, block_k=16, target_programs=64))
    launches = {}
    steps: dict[str, list[tuple[int | None, int]]] = {
        "few tiles": [(4, 20), (0, 1)],
        "many tiles": [(4, 200), (0, 1), (1, 90)],
    }
    for name, step in steps.items():
        case = build_case(TINY, torch.bfloat16, list(TINY_ADAPTERS), step, seed=47)
        group = case.meta.whole()
        assert group.kind(SETTINGS) == "mixed", name
        x = torch.randn((case.num_tokens, TINY.hidden), device=DEVICE).to(torch.bfloat16)
        launch = lora_shrink.shrink_launch(x, case.flat_layer, case.meta, 0, 3, group, settings=SETTINGS)[1]
        assert launch is not None
        launches[name] = launch
    splits = {name: launch._grid[2] for name, launch in launches.items()}  # noqa: SLF001 - the launch's grid
    assert splits["few tiles"] > 1 and splits["many tiles"] == 1, splits
    signature = inspect.signature(lora_shrink._lora_shrink_kernel.fn)  # noqa: SLF001 - the kernel's Python function
    constexprs = [name for name, p in signature.parameters.items() if p.annotation == "tl.constexpr"]
    assert "BLOCK_M" in constexprs and "x_ptr" not in constexprs
    values = [{c: dict(zip(launch._names, launch._values))[c] for c in constexprs} for launch in launches.values()]  # noqa: SLF001
    assert values[0] == values[1]


def test_lora_decode_tiles_of_several_tokens() -> None:
    """Decodes of two adapters (rank 64; ranks up to 128) five tokens each: full GEMV tiles of several tokens."""
    step: list[tuple[int | None, int]] = [(4 + i % 2, 1) for i in range(10)] + [(None, 1)]
    case = build_case(TINY, torch.bfloat16, list(TINY_ADAPTERS), step, seed=29)
    check_layer(case, "triton", seed=30)


def test_lora_decode_step_on_tensor_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of decodes through the tensor-core kernels with decode-shaped tiles (the mixed steps' configs) instead
    of the GEMV kernels."""
    for name in ("DECODE", "DECODE_ONE"):
        monkeypatch.setattr(lora_shrink, name, lora_shrink.MIXED)
        monkeypatch.setattr(lora_expand, name, lora_expand.MIXED)
    case = build_case(TINY, torch.bfloat16, list(TINY_ADAPTERS), TINY_STEPS["decode"], seed=27)
    check_layer(case, "triton", seed=28)


@pytest.mark.parametrize("step", ["mixed", "prefill"])
def test_lora_expand_programs_of_several_column_blocks(step: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensor-core expand programs that add three narrow column blocks each, so that a program's last blocks run
    past a module's width (and past the narrower k, v): every column still gets its delta once."""
    for name in ("MIXED", "PREFILL"):
        config = dataclasses.replace(getattr(lora_expand, name), block_n=(16,), n_chunks=3)
        monkeypatch.setattr(lora_expand, name, config)
    case = build_case(TINY, torch.bfloat16, list(TINY_ADAPTERS), TINY_STEPS[step], seed=31)
    check_layer(case, "triton", seed=32)


@pytest.mark.parametrize("block_r", [8, 16])
def test_gemv_expand_after_the_tensor_core_shrink(block_r: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step with prompts and decodes: the tensor-core shrink's sums on 16-token tiles, expanded by the GEMV kernel
    on those same tiles (a prompt's tile is 16 tokens one after the other, a decode's one), with rank chunks narrower
    than the largest ranks: every token gets its delta once."""
    config = lora_expand.ExpandConfig(lora_shrink.MIXED.block_m, block_r, (32,), 1024, 4, 2, gemv=True)
    monkeypatch.setattr(lora_expand, "MIXED", config)
    case = build_case(TINY, torch.bfloat16, list(TINY_ADAPTERS), TINY_STEPS["mixed"], seed=33)
    assert case.meta.whole().kind(SETTINGS) == "mixed"
    check_layer(case, "triton", seed=34)


def test_lora_call_shrink_and_expand_called_apart() -> None:
    """A LoraCall's shrink and expand, called one after the other (as benchmarks time them), give the call's delta;
    an expand repeated without a new shrink adds the same delta again (it reads the last shrink's v)."""
    case = build_case(TINY, torch.float32, list(TINY_ADAPTERS), TINY_STEPS["mixed"], seed=35)
    modules, offsets, widths, in_features = layer_calls(case.shape)[0]
    x = torch.randn((case.num_tokens, in_features), device=DEVICE)
    y0 = torch.randn((case.num_tokens, sum(widths)), device=DEVICE)
    expected = y0.clone()
    lora_ref(expected, x, case.flat_layer, case.meta, modules, offsets, widths)
    y = y0.clone()
    calls = lora_call.lora_calls(y, x, case.flat_layer, case.meta, modules, offsets, widths, SETTINGS)
    assert calls
    for call in calls:
        call.shrink(x, case.flat_layer)
        call.expand(y, case.flat_layer)
    magnitude = float((expected - y0).abs().max())
    assert_close(y, expected, torch.float32, magnitude)
    for call in calls:
        call.expand(y, case.flat_layer)
    assert_close(y, y0 + 2 * (expected - y0), torch.float32, magnitude)


@pytest.mark.parametrize("step", ["decode", "mixed"])
def test_expand_programs_cover_each_modules_own_columns(step: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused q/k/v expand of a GQA shape (k and v narrower than q) launches a program per tile and column block
    of each module, none for columns a narrower module lacks: with 32-column blocks, q's 64 columns take two, k's
    and v's 32 one each (four, where a grid sized for the widest module would launch six); every column still gets
    its delta."""
    for name in ("DECODE", "MIXED"):
        monkeypatch.setattr(lora_expand, name, dataclasses.replace(getattr(lora_expand, name), block_n=(32,)))
    case = build_case(TINY, torch.bfloat16, list(TINY_ADAPTERS), TINY_STEPS[step], seed=37)
    check_layer(case, "triton", seed=38)
    modules, offsets, widths, in_features = layer_calls(case.shape)[0]
    assert len(set(widths)) > 1, "a GQA shape: q wider than k and v"
    x = torch.randn((case.num_tokens, in_features), device=DEVICE).to(torch.bfloat16)
    y = torch.zeros((case.num_tokens, sum(widths)), device=DEVICE).to(torch.bfloat16)
    group = case.meta.whole()
    v, _ = lora_shrink.shrink_launch(x, case.flat_layer, case.meta, 0, 3, group, settings=SETTINGS)
    launch = lora_expand.expand_launch(y, v, case.flat_layer, case.meta, 0, offsets, widths, group, settings=SETTINGS)
    assert launch is not None
    cfg = lora_expand.expand_config(group, 3, SETTINGS)
    block_n = lora_expand.expand_block_n(cfg, int(group.tiles(cfg.block_m).shape[0]), widths)
    per_module = [-(-w // (block_n * cfg.n_chunks)) for w in widths]
    assert per_module == [2, 1, 1]
    num_tiles = int(group.tiles(cfg.block_m).shape[0])
    assert launch._grid == (num_tiles, 4, 1)  # noqa: SLF001 - the launch's grid
    assert lora_expand.column_blocks(widths, block_n * cfg.n_chunks) == tuple(itertools.accumulate(per_module))


@pytest.mark.parametrize("n_chunks", [1, 3])
@pytest.mark.parametrize("step", ["mixed", "prefill"])
def test_tensor_core_expand_with_bt_read_before_the_wait(
    step: str, n_chunks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ExpandConfig.prefetch: the first Bᵀ chunk of a program read ahead, the later chunks (ranks above the chunk's
    16 rows, and further column blocks) read in the loop: every column still gets its delta once."""
    for name in ("MIXED", "PREFILL"):
        config = dataclasses.replace(getattr(lora_expand, name), block_n=(16,), n_chunks=n_chunks, prefetch=True)
        monkeypatch.setattr(lora_expand, name, config)
    case = build_case(TINY, torch.bfloat16, list(TINY_ADAPTERS), TINY_STEPS[step], seed=39)
    assert max(max(r) for r in TINY_ADAPTERS) > lora_expand.MIXED.block_r, "ranks of several chunks"
    check_layer(case, "triton", seed=40)


def test_expand_config_rejects_column_blocks_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="prefetch"):
        dataclasses.replace(lora_expand.DECODE, prefetch=True)
    with pytest.raises(ValueError, match="n_chunks"):
        dataclasses.replace(lora_expand.MIXED, n_chunks=0)
    with pytest.raises(ValueError, match="n_chunks"):
        dataclasses.replace(lora_expand.DECODE, n_chunks=2)


def test_lora_kernel_kind_follows_the_step() -> None:
    """GEMV kernels for a step of decodes only (configs of their own for one-module calls), tensor-core tiles once
    a prompt is in the step."""
    kinds = {}
    steps = {**TINY_STEPS, "prompts": [(4, 70), (None, 5), (0, 20)]}  # "prefill" has prompts of 3 and 7 tokens
    for name in ("decode", "mixed", "prefill", "prompts"):
        group = build_case(TINY, torch.float32, list(TINY_ADAPTERS), steps[name], seed=3).meta.whole()
        kinds[name] = (lora_shrink.shrink_config(group, 3), lora_expand.expand_config(group, 3))
        single = (lora_shrink.shrink_config(group, 1), lora_expand.expand_config(group, 1))
        assert single == (kinds[name] if name != "decode" else (lora_shrink.DECODE_ONE, lora_expand.DECODE_ONE))
    assert kinds["decode"] == (lora_shrink.DECODE, lora_expand.DECODE)
    assert kinds["mixed"] == (lora_shrink.MIXED, lora_expand.MIXED)
    assert kinds["prefill"] == (lora_shrink.MIXED, lora_expand.MIXED)
    assert kinds["prompts"] == (lora_shrink.PREFILL, lora_expand.PREFILL)
    assert lora_shrink.DECODE.gemv and lora_expand.DECODE.gemv and not lora_shrink.MIXED.gemv
    assert lora_shrink.DECODE_ONE.gemv and lora_expand.DECODE_ONE.gemv
    # decode graphs fill one static tile table that every decode kernel reads (and one for few adapters, which
    # every mixed kernel reads); graphs of steps with prompts one for their decodes and one for the prompt kernels
    decode = (lora_shrink.DECODE, lora_expand.DECODE, lora_shrink.DECODE_ONE, lora_expand.DECODE_ONE)
    blocks = {c.block_m for c in decode}
    decode_block, few_block, prompt_block = static_lora.tile_blocks()
    assert blocks == {decode_block}
    assert {lora_shrink.MIXED.block_m, lora_expand.MIXED.block_m} == {few_block}
    assert {lora_shrink.PREFILL.block_m, lora_expand.PREFILL.block_m} == {prompt_block}


def test_decodes_of_few_adapters_get_tensor_core_tiles() -> None:
    """Decodes over at most few_adapters_max adapters (with base-model tokens between them) run on the 16-token
    tensor-core tiles and match the reference; over one adapter more they stay on the GEMV kernels, and so do
    fewer than few_adapters_min_tokens tokens."""
    tokens = SETTINGS.few_adapters_min_tokens
    few: list[tuple[int | None, int]] = []
    for i in range(tokens):
        if i % 8 == 0:
            few.append((None, 1))
        few.append((i % 4 + 2, 1))
    group = build_case(TINY, torch.float32, list(TINY_ADAPTERS), few, seed=41).meta.whole()
    assert sum(end - start for _, start, end, _ in group.segments) == tokens and len(group.segments) == 4
    assert (lora_shrink.shrink_config(group, 3, SETTINGS), lora_expand.expand_config(group, 3, SETTINGS)) == (
        lora_shrink.MIXED,
        lora_expand.MIXED,
    )
    few_group = build_case(TINY, torch.float32, list(TINY_ADAPTERS), few[:-1], seed=41).meta.whole()
    assert few_group.kind(SETTINGS) == "decode"
    count = SETTINGS.few_adapters_max + 1
    many: list[tuple[int | None, int]] = [(None, 1)] + [(i % count, 1) for i in range(max(tokens, count))]
    adapters = list(TINY_ADAPTERS) + [(2, 2, 2, 2, 2, 2, 2)] * (count - len(TINY_ADAPTERS))
    assert build_case(TINY, torch.float32, adapters, many, seed=41).meta.whole().kind(SETTINGS) == "decode"
    check_layer(build_case(TINY, torch.bfloat16, list(TINY_ADAPTERS), few, seed=43), "triton", seed=44)


def test_the_few_adapters_rule_can_be_set() -> None:
    """EngineConfig's few_adapters_min_tokens and few_adapters_max (the rule 32 tokens, 8 adapters by default) reach
    the kernels as KernelSettings; values that cannot be a rule are refused naming the field."""
    assert EngineConfig().kernel_settings() == SETTINGS
    assert (SETTINGS.few_adapters_min_tokens, SETTINGS.few_adapters_max) == (32, 8)
    rule = EngineConfig.from_dict({"few_adapters_min_tokens": "64", "few_adapters_max": "8"}).kernel_settings()
    assert (rule.few_adapters_min_tokens, rule.few_adapters_max) == (64, 8)
    assert rule.few_adapters(64, 8) and not rule.few_adapters(63, 8) and not rule.few_adapters(64, 9)
    group = SegmentGroup([(a, 2 * a, 2 * a + 2, a) for a in range(4)], torch.device("cpu"))  # 8 decodes, 4 adapters
    assert group.kind(SETTINGS) == "decode" and group.kind(KernelSettings(few_adapters_min_tokens=8)) == "mixed"
    for field, value in (("few_adapters_min_tokens", "-1"), ("few_adapters_max", "eight")):
        with pytest.raises(ValueError, match=field):
            EngineConfig.from_dict({field: value})


@pytest.mark.parametrize("step", sorted(TINY_STEPS))
def test_padded_bmm_matches_reference(step: str) -> None:
    case = build_case(TINY, torch.float32, list(TINY_ADAPTERS), TINY_STEPS[step], seed=5)
    check_layer(case, "bmm", seed=6)


def test_step_without_lora_modules_leaves_y() -> None:
    """Adapters that target none of the called modules: nothing is launched and y is unchanged."""
    case = build_case(TINY, torch.float32, [(0, 0, 0, 0, 8, 8, 8)], [(0, 2), (None, 1)], seed=7)
    x = torch.randn((3, TINY.hidden), device=DEVICE)
    y = torch.randn((3, TINY.hidden), device=DEVICE)
    before = y.clone()
    TritonOps().lora(y, x, case.flat_layer, case.meta, (O,), (0,), (TINY.hidden,))
    assert torch.equal(y, before)


def test_length_groups_put_decodes_apart_from_prompts() -> None:
    """Attention's launch groups (length_groups): segments of up to SHORT_SEGMENT tokens form their own group
    (decode tiles), the long ones another; here on a step's LoRA segments."""
    for name, sizes in (
        ("mixed", [[1, 1, 1], [20, 17]]),
        ("decode", [[3, 1, 1, 1, 1, 1]]),
        ("prefill", [[7, 3], [70]]),
    ):
        meta = build_case(TINY, torch.float32, list(TINY_ADAPTERS), TINY_STEPS[name], seed=3).meta
        groups = length_groups(meta.whole().segments, meta.seg_start.device, split=True)
        assert [sorted((e - s for _, s, e, _ in g.segments), reverse=True) for g in groups] == [
            sorted(z, reverse=True) for z in sizes
        ], name
        assert [g.max_segment_len for g in groups] == [max(z) for z in sizes]
        covered = sorted(seg for g in groups for seg in g.segments)
        assert covered == sorted(meta.whole().segments), "every segment in exactly one group"
        tiles = torch.cat([g.tiles(16) for g in groups]).cpu()
        assert int((tiles[:, 2] - tiles[:, 1]).clamp(max=16).sum()) == meta.seg_start_host[-1] - meta.seg_start_host[0]


def test_lora_launches_decodes_and_prompts_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """With lora_split off, one shrink per run of fused modules whatever the step mixes (fewer launches on an eager
    step); a step with any decode gets decode-shaped tiles, a step of prompts only prefill-shaped ones."""
    together = KernelSettings(lora_split=False)
    built: list[int] = []
    shrink = lora_call.shrink_launch
    monkeypatch.setattr(
        lora_call, "shrink_launch", lambda *a, **kw: built.append(a[2].whole().tile_len) or shrink(*a, **kw)
    )
    long_prompts = [(4, 70), (None, 5), (0, 20)]
    cases = {"mixed": (TINY_STEPS["mixed"], 16), "decode": (TINY_STEPS["decode"], 3), "prompts": (long_prompts, 70)}
    for name, (step, tile_len) in cases.items():  # decode: one adapter has three tokens
        built.clear()
        check_layer(build_case(TINY, torch.float32, list(TINY_ADAPTERS), step, seed=3), "triton", 4, together)
        assert built == [tile_len] * 4, (name, built)  # q/k/v, o, gate/up, down: one launch pair each


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_steps_launch_decodes_apart_from_prompts(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """Split launches (EngineConfig.lora_split): a step with decodes and prompts launches its decodes on the GEMV
    kernels and its prompts on prompt tiles, one pair each, and still matches the reference; a step of one kind keeps
    one pair. The setting's default (lora_split=false turns it off)."""
    split = EngineConfig().kernel_settings()
    assert split.lora_split
    assert not EngineConfig.from_dict({"lora_split": "false"}).kernel_settings().lora_split
    configs: list[tuple[object, int]] = []
    shrink = lora_call.shrink_launch

    def recording(
        x: torch.Tensor,
        flat: torch.Tensor,
        meta: LoraMeta,
        first: int,
        slices: int,
        group: SegmentGroup,
        pdl: bool,
        *,
        settings: KernelSettings,
    ) -> tuple[torch.Tensor, Relaunch | None]:
        configs.append((lora_shrink.shrink_config(group, slices, settings), group.max_segment_len))
        return shrink(x, flat, meta, first, slices, group, pdl=pdl, settings=settings)

    monkeypatch.setattr(lora_call, "shrink_launch", recording)
    check_layer(build_case(TINY, dtype, list(TINY_ADAPTERS), TINY_STEPS["mixed"], seed=3), "triton", 4, split)
    fused, single = (lora_shrink.DECODE, 1), (lora_shrink.DECODE_ONE, 1)
    prompts = (lora_shrink.PREFILL, 20)  # the mixed step's prompts: 20 and 17 tokens
    assert configs == [fused, prompts, single, prompts, fused, prompts, single, prompts], configs
    configs.clear()
    check_layer(build_case(TINY, dtype, list(TINY_ADAPTERS), TINY_STEPS["decode"], seed=3), "triton", 4, split)
    assert [config for config, _ in configs] == [lora_shrink.DECODE, lora_shrink.DECODE_ONE] * 2


def test_consecutive_runs() -> None:
    runs = list(consecutive_runs((0, 1, 2, 4, 5, 6), (0, 8, 12, 16, 20, 30), (8, 4, 4, 4, 10, 2)))
    assert runs == [(0, (0, 8, 12), (8, 4, 4)), (4, (16, 20, 30), (4, 10, 2))]
    assert list(consecutive_runs((0, 2), (0, 5), (5, 5))) == [(0, (0,), (5,)), (2, (5,), (5,))]


# Full shapes on the GPU: up to 64 adapters with ranks {1, 3, 8, 16, 64, 128} mixed in one batch.
RANKS = (1, 3, 8, 16, 64, 128)


def gpu_adapters(count: int) -> list[tuple[int, ...]]:
    targets = [ALL, (1, 0, 1, 0, 0, 0, 0), (0, 0, 0, 0, 1, 1, 1), (1, 1, 1, 1, 0, 0, 0), (0, 1, 0, 1, 1, 0, 1)]
    ranks = itertools.cycle(RANKS)
    return [tuple(next(ranks) * t for t in targets[i % len(targets)]) for i in range(count)]


def gpu_step(kind: str, count: int) -> list[tuple[int | None, int]]:
    decodes: list[tuple[int | None, int]] = [(i % count, 1) for i in range(64)] + [(None, 1)] * 4
    if kind == "decode":
        return decodes
    return [(0, 300), (None, 40), (count - 1, 77)] + decodes[:16]


GPU_CASES = [(s, torch.bfloat16) for s in FULL_SHAPES] + [
    (FULL_SHAPES[2], torch.float16),
    (FULL_SHAPES[2], torch.float32),
]


@gpu_only
@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("count", [1, 8, 64])
@pytest.mark.parametrize(("shape", "dtype"), GPU_CASES, ids=[f"{s}-{d}" for s, d in GPU_CASES])
def test_lora_full_shapes(shape: Shape, dtype: torch.dtype, count: int, kind: str) -> None:
    case = build_case(shape, dtype, gpu_adapters(count), gpu_step(kind, count), seed=count)
    check_layer(case, "triton", seed=count + 1)


@gpu_only
@pytest.mark.parametrize("shape", FULL_SHAPES, ids=str)
def test_padded_bmm_full_shapes(shape: Shape) -> None:
    case = build_case(shape, torch.bfloat16, gpu_adapters(8), gpu_step("decode", 8), seed=11)
    check_layer(case, "bmm", seed=12)


@gpu_only
def test_lora_rows_beyond_int32_offsets() -> None:
    """A pool layer of more than 2**31 elements, adapters at its top: row offsets need 64-bit arithmetic."""
    shape = FULL_SHAPES[2]
    page_elems = 16 * 2 * shape.kv_heads * shape.head_dim
    case = build_case(
        shape, torch.bfloat16, gpu_adapters(8), gpu_step("mixed", 8), 9, low_pages=(1 << 31) // page_elems
    )
    assert int(case.meta.a_rows.min()) >= 1 << 31
    check_layer(case, "triton", seed=10)


def test_lora_64_adapters_decode() -> None:
    """64 adapters of ranks 1 to 128 with assorted targets, one decode token each, plus base tokens."""
    case = build_case(TINY, torch.bfloat16, gpu_adapters(64), gpu_step("decode", 64), seed=13)
    check_layer(case, "triton", seed=14)


def test_lora_smollm2_shape() -> None:
    """A real model's widths (SmolLM2-135M: hidden 576, intermediate 1536, 9 heads, 3 kv heads of 64)."""
    step = [(0, 20), (None, 3), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1)]
    case = build_case(FULL_SHAPES[0], torch.bfloat16, gpu_adapters(6), step, seed=15)
    check_layer(case, "triton", seed=16)


def save_peft_adapter(path: Path, shape: Shape, ranks: dict[str, int], seed: int) -> Path:
    """A PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) for a one-layer model."""
    from safetensors.torch import save_file

    spec = model_spec(shape)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, rank in ranks.items():
        parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        in_features, out_features = spec.module_shape(module)
        key = f"base_model.model.model.layers.0.{parent}.{module}"
        tensors[f"{key}.lora_A.weight"] = torch.randn((rank, in_features), generator=gen) * 0.1
        tensors[f"{key}.lora_B.weight"] = torch.randn((out_features, rank), generator=gen) * 0.1
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": max(ranks.values()), "lora_alpha": 8, "target_modules": list(ranks)}
    config["rank_pattern"] = {m: r for m, r in ranks.items() if r != config["r"]}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def test_lora_adapters_from_peft_loader(tmp_path: Path) -> None:
    """Adapters read by the engine's PEFT loader (its own page layout), made resident in a scrambled pool."""
    geometry = PoolGeometry(num_layers=1, block_size=4, num_kv_heads=TINY.kv_heads, head_dim=TINY.head_dim)
    specs = [{"q_proj": 4, "v_proj": 4, "down_proj": 2}, {"k_proj": 9, "gate_proj": 9, "up_proj": 9, "o_proj": 1}]
    hosts = [
        load_peft_adapter(
            f"p{i}", save_peft_adapter(tmp_path / f"p{i}", TINY, s, i), model_spec(TINY), geometry, torch.bfloat16
        )
        for i, s in enumerate(specs)
    ]
    pool = scrambled_pool(geometry, adapter_pages(hosts) + 5, torch.bfloat16, seed=17)
    residents = make_resident(pool, hosts)
    meta, _ = lora_step([residents[1], None, residents[0], residents[1]], [1, 2, 19, 1])
    case = LayerCase(TINY, torch.bfloat16, pool.flat_layer(0), meta, 23)
    check_layer(case, "triton", seed=18)
