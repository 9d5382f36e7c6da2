"""The projection with its LoRA expand in the epilogue (kernels/lora_gemm.py) against torch: F.linear, then the
plain-torch LoRA reference on the same step, pool and adapters as the shrink/expand kernels' tests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from slora.kernels import lora_gemm  # noqa: E402
from slora.kernels.lora_gemm import GemmConfig, column_block, gemm_launch, lora_gemm_launch  # noqa: E402
from slora.kernels.lora_ref import lora_ref  # noqa: E402
from tests.kernels.builders import DEVICE, FULL_SHAPES, TINY, Shape, assert_close, gpu_only  # noqa: E402
from tests.kernels.test_lora import TINY_ADAPTERS, TINY_STEPS, LayerCase, build_case, layer_calls  # noqa: E402

SMALL = GemmConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# 64 decodes over 4 adapters (base-model tokens between them): the few-adapter steps this kernel is for.
FEW = [(i % 4 + 2 if i % 9 else None, 1) for i in range(72)]


def fused(case: LayerCase, x: torch.Tensor, weight: torch.Tensor, widths: tuple[int, ...], modules: tuple[int, ...],
          cfg: GemmConfig) -> torch.Tensor:  # fmt: skip
    y = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    lora_gemm_launch(x, weight, y, case.flat_layer, case.meta, modules[0], widths, cfg=cfg)(
        x, weight, y, case.flat_layer
    )
    return y


def check_fused_layer(case: LayerCase, cfg: GemmConfig, seed: int) -> None:
    """Every call of the layer: the fused launch against F.linear + lora_ref; rows of base-model tokens equal to the
    same kernel's plain GEMM, bit for bit."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    base_rows = case.meta.token_adapter.to(DEVICE) < 0
    for call in layer_calls(case.shape):
        modules, offsets, widths, in_features = call
        x = torch.randn((case.num_tokens, in_features), generator=gen, device=DEVICE).to(case.dtype)
        weight = (torch.randn((sum(widths), in_features), generator=gen, device=DEVICE) * 0.1).to(case.dtype)
        expected = F.linear(x, weight)
        plain = expected.clone()
        lora_ref(expected, x, case.flat_layer, case.meta, modules, offsets, widths)
        actual = fused(case, x, weight, widths, modules, cfg)
        assert_close(actual, expected, case.dtype, float(expected.float().abs().max()))
        gemm = torch.empty_like(actual)
        gemm_launch(x, weight, gemm, cfg=cfg, widths=widths)(x, weight, gemm)
        assert torch.equal(actual[base_rows], gemm[base_rows]), f"modules {modules}: LoRA added to base-model rows"
        delta = (actual.float() - plain.float()).abs().amax(dim=1)
        assert bool((delta[~base_rows] > 0).any()), f"modules {modules}: no LoRA delta (a broken test case)"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 5, 37])
def test_gemm_matches_linear(dtype: torch.dtype, bias: bool, m: int) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(m)
    x = torch.randn((m, 96), generator=gen, device=DEVICE).to(dtype)
    weight = torch.randn((160, 96), generator=gen, device=DEVICE).to(dtype)
    b = torch.randn(160, generator=gen, device=DEVICE).to(dtype) if bias else None
    y = torch.empty((m, 160), dtype=dtype, device=DEVICE)
    launch = gemm_launch(x, weight, y, b, cfg=SMALL)
    if b is None:
        launch(x, weight, y)
    else:
        launch(x, weight, y, b)
    expected = F.linear(x, weight, b)
    assert_close(y, expected, dtype, float(expected.float().abs().max()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("step", ["few", *sorted(TINY_STEPS)])
def test_gemm_with_lora_matches_reference(dtype: torch.dtype, step: str) -> None:
    """Adapters of ranks 1-128 with partial targets (a gap inside q/k/v), base-model tokens among them, row blocks
    of 16 tokens that cut through segments."""
    steps = {"few": FEW, **TINY_STEPS}
    check_fused_layer(build_case(TINY, dtype, list(TINY_ADAPTERS), steps[step], seed=7), SMALL, seed=8)


@pytest.mark.parametrize("step", ["few", "prefill"])
def test_shrink_splits_and_every_layer_after_the_first(step: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Input features split across shrink programs (their partials summed by the tile's last split), and one
    launch run again (the next layer): its counters must be back at zero."""
    monkeypatch.setattr(lora_gemm, "SHRINK_K", 16)
    case = build_case(TINY, torch.bfloat16, list(TINY_ADAPTERS), {"few": FEW, **TINY_STEPS}[step], seed=14)
    gen = torch.Generator(device=DEVICE).manual_seed(15)
    launch = None
    for _ in range(2):  # two layers
        x = torch.randn((case.num_tokens, 64), generator=gen, device=DEVICE).to(torch.bfloat16)
        weight = (torch.randn((160, 64), generator=gen, device=DEVICE) * 0.1).to(torch.bfloat16)
        y = torch.empty((case.num_tokens, 160), dtype=torch.bfloat16, device=DEVICE)
        if launch is None:
            launch = lora_gemm_launch(x, weight, y, case.flat_layer, case.meta, 0, (64, 48, 48), cfg=SMALL)
            assert launch.grid[0] > 4 * 3, "expected K split four ways over the shrink's programs"
        launch(x, weight, y, case.flat_layer)
        expected = F.linear(x, weight)
        lora_ref(expected, x, case.flat_layer, case.meta, (0, 1, 2), (0, 64, 112), (64, 48, 48))
        assert_close(y, expected, torch.bfloat16, float(expected.float().abs().max()))


def test_gemm_with_lora_on_one_row_block() -> None:
    """The config for 72 rows: every token in one row block, every tile's rows added by each column block."""
    cfg = lora_gemm.gemm_config(72, 96, 64)
    assert cfg.block_m == 128
    check_fused_layer(build_case(TINY, torch.bfloat16, list(TINY_ADAPTERS), FEW, seed=9), cfg, seed=10)


def test_column_blocks_stay_inside_a_module() -> None:
    assert column_block(64, (4096, 1024, 1024)) == 64
    assert column_block(128, (576, 192, 192)) == 64
    assert column_block(64, (96, 32, 32)) == 32


def test_bad_inputs_are_named() -> None:
    x = torch.zeros((4, 64), device=DEVICE)
    with pytest.raises(ValueError, match="are not"):
        gemm_launch(x, torch.zeros((32, 48), device=DEVICE), torch.zeros((4, 32), device=DEVICE))
    with pytest.raises(ValueError, match="multiples of 16"):
        gemm_launch(x, torch.zeros((40, 64), device=DEVICE), torch.zeros((4, 40), device=DEVICE), widths=(24, 16))
    case = build_case(TINY, torch.float32, list(TINY_ADAPTERS), FEW, seed=11)
    x = torch.zeros((case.num_tokens, 64), device=DEVICE)
    weight, y = torch.zeros((96, 64), device=DEVICE), torch.zeros((case.num_tokens, 96), device=DEVICE)
    with pytest.raises(ValueError, match="are not LoRA modules"):
        lora_gemm_launch(x, weight, y, case.flat_layer, case.meta, 6, (48, 48))


def test_steps_of_many_tiles_are_refused() -> None:
    """Every GEMM program runs each tile's step: a step of more than MAX_TILES tiles is named and refused."""
    adapters = list(TINY_ADAPTERS) + [(2,) * 7] * (lora_gemm.MAX_TILES + 2 - len(TINY_ADAPTERS))
    case = build_case(TINY, torch.float32, adapters, [(i, 1) for i in range(len(adapters))], seed=16)
    x = torch.zeros((case.num_tokens, 64), device=DEVICE)
    weight, y = torch.zeros((96, 64), device=DEVICE), torch.zeros((case.num_tokens, 96), device=DEVICE)
    with pytest.raises(ValueError, match=f"at most {lora_gemm.MAX_TILES} tiles"):
        lora_gemm_launch(x, weight, y, case.flat_layer, case.meta, 4, (96,))


@gpu_only
@pytest.mark.parametrize("shape", FULL_SHAPES, ids=str)
def test_gemm_with_lora_full_shapes(shape: Shape) -> None:
    adapters: list[tuple[int, ...]] = [
        (64, 64, 64, 64, 64, 64, 64),
        (16, 0, 16, 16, 8, 8, 8),
        (128, 128, 128, 0, 0, 0, 128),
        (8,) * 7,
    ]
    few = [(i % 4 if i % 7 else None, 1) for i in range(96)]
    check_fused_layer(
        build_case(shape, torch.bfloat16, adapters, few, seed=12), lora_gemm.gemm_config(96, 0, 0), seed=13
    )
