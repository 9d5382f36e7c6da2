"""Fused RMSNorm (with and without the residual add) and in-place rotary embedding, against the torch references.

The references run on copies of the inputs, before the kernels. The residual sum must be bit-exact; the norm output
and the rotated q/k within an ulp or two of the dtype (the kernels round once where torch rounds a few times, and
sum squares in another order). x is a column slice of a wider tensor; q and k are views of one fused qkv buffer,
whose v part must come back untouched; positions are scrambled, some repeated.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

pytest.importorskip("triton")

from slora.backend.model.rope import RotaryTable  # noqa: E402
from slora.backend.model.spec import RopeSpec  # noqa: E402
from slora.kernels.reference.attention import write_kv_ref  # noqa: E402
from slora.kernels.reference.norm import rms_norm_ref  # noqa: E402
from slora.kernels.reference.rotary import apply_rotary_ref  # noqa: E402
from slora.kernels.triton.kv_write import write_kv  # noqa: E402
from slora.kernels.triton.norm import rms_norm  # noqa: E402
from slora.kernels.triton.rotary import apply_rotary_, apply_rotary_write_kv_  # noqa: E402
from tests.kernels.builders import DEVICE, Heads, gpu_only  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# One unit in the last place, relative to the value: float32 a few ulps (1.2e-7 each), the half types 1 ulp.
ULP = {torch.float32: 1e-6, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
CPU_HIDDEN = (576, 2048)
FULL_HIDDEN = (576, 2048, 4096, 5120, 8192)
CPU_TOKENS = (1, 3, 17)
EPS = 1e-5


def assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor, ulps: float) -> None:
    """|actual - expected| <= ulps * ULP[dtype] * scale, elementwise; scale: the size of what was rounded."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    err = (actual.float() - expected.float()).abs()
    bound = ulps * ULP[expected.dtype] * (scale.float() + torch.finfo(expected.dtype).tiny)
    bad = err > bound
    worst = float((err / bound).max())
    assert not bool(bad.any()), f"{int(bad.sum())} of {err.numel()} elements off, worst {worst:.1f}x the bound"


# ---------------------------------------------------------------- RMSNorm


def check_rms_norm(num_tokens: int, hidden: int, dtype: torch.dtype, with_residual: bool, seed: int) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    randn = lambda *shape: torch.randn(shape, generator=gen, device=DEVICE)  # noqa: E731
    wide = (3 * randn(num_tokens, hidden + 40)).to(dtype)
    x = wide[:, 7 : 7 + hidden]  # row stride hidden + 40, not 16-byte aligned
    residual = (3 * randn(num_tokens, 2 * hidden)).to(dtype)[:, :hidden] if with_residual else None
    weight = (1 + 0.5 * randn(hidden)).to(dtype)
    x_before = x.clone()
    residual_before = None if residual is None else residual.clone()
    expected_out, expected_s = rms_norm_ref(x.clone(), weight.clone(), EPS, residual_before)

    out, s = rms_norm(x, weight, EPS, residual)

    assert out.is_contiguous() and out.shape == (num_tokens, hidden)
    assert torch.equal(x, x_before)
    if residual is None:
        assert s is x
    else:
        assert s.is_contiguous() and s.data_ptr() not in (x.data_ptr(), residual.data_ptr())
        assert residual_before is not None and torch.equal(residual, residual_before)
        assert torch.equal(s, expected_s)  # the residual stream is bit-exact
    assert_within_ulps(out, expected_out, expected_out.abs(), ulps=2)
    if dtype != torch.float32:
        # Same roundings as torch: only a sum of squares off by an ulp can flip a rounding, which is rare.
        same = (out == expected_out).float().mean().item()
        assert same >= 0.99, f"only {same:.1%} of the outputs are bit-equal to the reference"


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", CPU_HIDDEN)
@pytest.mark.parametrize("num_tokens", CPU_TOKENS)
def test_rms_norm(num_tokens: int, hidden: int, dtype: torch.dtype, with_residual: bool) -> None:
    check_rms_norm(num_tokens, hidden, dtype, with_residual, seed=num_tokens + hidden)


def test_rms_norm_small_hidden_and_no_tokens() -> None:
    """A hidden size below one warp's worth, and an empty batch."""
    check_rms_norm(5, 24, torch.bfloat16, True, seed=1)
    x = torch.empty((0, 64), device=DEVICE)
    out, s = rms_norm(x, torch.ones(64, device=DEVICE), EPS, torch.empty((0, 64), device=DEVICE))
    assert out.shape == s.shape == (0, 64)


@gpu_only
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", FULL_HIDDEN)
def test_rms_norm_full_shapes(hidden: int, dtype: torch.dtype, with_residual: bool) -> None:
    check_rms_norm(3000, hidden, dtype, with_residual, seed=hidden)


# ---------------------------------------------------------------- rotary


# GQA, MHA, a head_dim whose half is not a power of two, and enough heads for several (partial) blocks per token.
CPU_HEADS = (Heads(8, 2, 64), Heads(4, 4, 128), Heads(6, 1, 24), Heads(40, 20, 128))
FULL_HEADS = (Heads(9, 3, 64), Heads(32, 8, 128), Heads(32, 32, 128), Heads(64, 8, 128), Heads(8, 2, 256))
MAX_POSITIONS = 4096
LLAMA3 = RopeSpec(
    theta=500000.0,
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)


def check_rotary(num_tokens: int, heads: Heads, dtype: torch.dtype, spec: RopeSpec, seed: int) -> None:
    table = RotaryTable(spec, heads.head_dim, MAX_POSITIONS, dtype, DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q_size, kv_size = heads.heads * heads.head_dim, heads.kv_heads * heads.head_dim
    qkv = torch.randn((num_tokens, q_size + 2 * kv_size), generator=gen, device=DEVICE).to(dtype)
    q_view, k_view, v_view = qkv.split((q_size, kv_size, kv_size), dim=-1)
    q = q_view.view(num_tokens, heads.heads, heads.head_dim)  # strided: row stride is the qkv width
    k = k_view.view(num_tokens, heads.kv_heads, heads.head_dim)
    # Scrambled positions, high ones included, repeats allowed.
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=gen, device=DEVICE)
    positions[0] = MAX_POSITIONS - 1
    q_before, k_before, v_before = q.clone(), k.clone(), v_view.clone()
    expected_q, expected_k = apply_rotary_ref(q_before, k_before, positions, table.cos, table.sin)

    apply_rotary_(q, k, positions, table.cos, table.sin)

    assert torch.equal(v_view, v_before)
    cos, sin = table.cos[positions].unsqueeze(1), table.sin[positions].unsqueeze(1)
    ulps = 1 if dtype == torch.float32 else 2
    assert_within_ulps(q, expected_q, rounded_terms(q_before, cos, sin) + expected_q.abs(), ulps)
    assert_within_ulps(k, expected_k, rounded_terms(k_before, cos, sin) + expected_k.abs(), ulps)


def check_rotary_write_kv(num_tokens: int, heads: Heads, dtype: torch.dtype, block_size: int, seed: int) -> None:
    """The fused rotary + K/V write against the torch references: q and k rotated in place as apply_rotary_ref
    (within ulps) and bit-equal to the separate Triton launches; each slot holds the rotated k and the untouched v;
    a token without a slot (-1) and every other slot write nothing."""
    table = RotaryTable(LLAMA3, heads.head_dim, MAX_POSITIONS, dtype, DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q_size, kv_size = heads.heads * heads.head_dim, heads.kv_heads * heads.head_dim
    qkv = torch.randn((num_tokens, q_size + 2 * kv_size), generator=gen, device=DEVICE).to(dtype)
    q_view, k_view, v_view = qkv.split((q_size, kv_size, kv_size), dim=-1)
    q = q_view.view(num_tokens, heads.heads, heads.head_dim)
    k = k_view.view(num_tokens, heads.kv_heads, heads.head_dim)
    v = v_view.view(num_tokens, heads.kv_heads, heads.head_dim)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=gen, device=DEVICE)
    num_pages = num_tokens // block_size + 3
    slots = torch.randperm(num_pages * block_size, generator=gen, device=DEVICE)[:num_tokens]  # scrambled pages
    slots[num_tokens // 2] = -1  # a token with no slot
    pool = torch.randn((num_pages, 2, block_size, heads.kv_heads, heads.head_dim), generator=gen, device=DEVICE)
    pool = pool.to(dtype)
    q_before, k_before, v_before, pool_before = q.clone(), k.clone(), v.clone(), pool.clone()
    expected_q, expected_k = apply_rotary_ref(q_before, k_before, positions, table.cos, table.sin)
    expected_pool = pool_before.clone()
    kept = slots >= 0
    write_kv_ref(expected_k[kept], v_before[kept], expected_pool, slots[kept])
    separate_q, separate_k, separate_pool = q.clone(), k.clone(), pool.clone()
    apply_rotary_(separate_q, separate_k, positions, table.cos, table.sin)
    write_kv(separate_k, v_before, separate_pool, slots)

    apply_rotary_write_kv_(q, k, v, positions, table.cos, table.sin, pool, slots)

    assert torch.equal(q, separate_q) and torch.equal(k, separate_k) and torch.equal(pool, separate_pool)
    assert torch.equal(v, v_before)
    cos, sin = table.cos[positions].unsqueeze(1), table.sin[positions].unsqueeze(1)
    ulps = 1 if dtype == torch.float32 else 2
    assert_within_ulps(q, expected_q, rounded_terms(q_before, cos, sin) + expected_q.abs(), ulps)
    assert_within_ulps(k, expected_k, rounded_terms(k_before, cos, sin) + expected_k.abs(), ulps)
    assert torch.equal(pool[:, 1], expected_pool[:, 1]), "V slots hold v's bits, other slots are untouched"
    k_scale = torch.ones_like(expected_pool[:, 0], dtype=torch.float32)  # the rounding of the rotated k only
    assert_within_ulps(pool[:, 0], expected_pool[:, 0], expected_pool[:, 0].abs() + k_scale, ulps)
    written = torch.zeros(num_pages * block_size, dtype=torch.bool, device=DEVICE)
    written[slots[kept]] = True
    untouched = (~written).view(num_pages, block_size)
    assert torch.equal(pool[:, 0][untouched], pool_before[:, 0][untouched])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", CPU_HEADS[:3], ids=str)
def test_rotary_write_kv(heads: Heads, dtype: torch.dtype) -> None:
    check_rotary_write_kv(7, heads, dtype, block_size=4, seed=heads.heads)


@gpu_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", FULL_HEADS, ids=str)
def test_rotary_write_kv_full_shapes(heads: Heads, dtype: torch.dtype) -> None:
    check_rotary_write_kv(3000, heads, dtype, block_size=16, seed=heads.heads)


def rounded_terms(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """|x * cos| + |rotate_half(x) * sin|: the reference rounds both products, and they may cancel."""
    x = x.float()
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return (x * cos.float()).abs() + (swapped * sin.float()).abs()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", CPU_HEADS, ids=str)
@pytest.mark.parametrize("num_tokens", CPU_TOKENS)
def test_rotary(num_tokens: int, heads: Heads, dtype: torch.dtype) -> None:
    check_rotary(num_tokens, heads, dtype, RopeSpec(theta=10000.0), seed=num_tokens)


def test_rotary_llama3_scaling_and_no_tokens() -> None:
    check_rotary(9, Heads(8, 2, 64), torch.bfloat16, LLAMA3, seed=2)
    q = torch.empty((0, 4, 64), device=DEVICE)
    table = RotaryTable(RopeSpec(theta=10000.0), 64, 16, torch.float32, DEVICE)
    apply_rotary_(q, q[:, :1], torch.empty(0, dtype=torch.int64, device=DEVICE), table.cos, table.sin)


@gpu_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", FULL_HEADS, ids=str)
def test_rotary_full_shapes(heads: Heads, dtype: torch.dtype) -> None:
    check_rotary(3000, heads, dtype, LLAMA3, seed=heads.heads)


# ---------------------------------------------------------------- argument checks


def _norm_args(**changes: torch.Tensor | None) -> Callable[[], object]:
    args: dict[str, torch.Tensor | None] = {
        "x": torch.zeros((3, 64), device=DEVICE),
        "weight": torch.ones(64, device=DEVICE),
        "residual": torch.zeros((3, 64), device=DEVICE),
    }
    args.update(changes)
    return lambda: rms_norm(args["x"], args["weight"], EPS, args["residual"])


NORM_ERRORS = {
    "x 3-D": (_norm_args(x=torch.zeros((3, 4, 16)), residual=None), r"x must be \[num_tokens, hidden\]"),
    "x int": (_norm_args(x=torch.zeros((3, 64), dtype=torch.int32), residual=None), "x must be float32"),
    "x column stride": (_norm_args(x=torch.zeros((3, 128))[:, ::2]), "x needs unit stride"),
    "weight length": (_norm_args(weight=torch.ones(65)), r"weight must be a contiguous \[64\]"),
    "weight strided": (_norm_args(weight=torch.ones(128)[::2]), r"weight must be a contiguous \[64\]"),
    "weight dtype": (_norm_args(weight=torch.ones(64, dtype=torch.bfloat16)), "weight dtype"),
    "residual shape": (_norm_args(residual=torch.zeros((4, 64))), "residual must be"),
    "residual dtype": (_norm_args(residual=torch.zeros((3, 64), dtype=torch.float16)), "residual must be"),
    "residual stride": (_norm_args(residual=torch.zeros((3, 128))[:, ::2]), "residual needs unit stride"),
}


@pytest.mark.parametrize("case", sorted(NORM_ERRORS))
def test_rms_norm_rejects(case: str) -> None:
    call, message = NORM_ERRORS[case]
    with pytest.raises(ValueError, match=message):
        call()


def _rotary_args(**changes: torch.Tensor) -> Callable[[], object]:
    args = {
        "q": torch.zeros((3, 4, 16), device=DEVICE),
        "k": torch.zeros((3, 2, 16), device=DEVICE),
        "positions": torch.zeros(3, dtype=torch.int64, device=DEVICE),
        "cos": torch.zeros((32, 16), device=DEVICE),
        "sin": torch.zeros((32, 16), device=DEVICE),
    }
    args.update(changes)
    return lambda: apply_rotary_(args["q"], args["k"], args["positions"], args["cos"], args["sin"])


ROTARY_ERRORS = {
    "q 2-D": (_rotary_args(q=torch.zeros((3, 64))), "q and k must be"),
    "k tokens": (_rotary_args(k=torch.zeros((4, 2, 16))), "same num_tokens and head_dim"),
    "k head_dim": (_rotary_args(k=torch.zeros((3, 2, 8))), "same num_tokens and head_dim"),
    "odd head_dim": (
        _rotary_args(q=torch.zeros((3, 4, 15)), k=torch.zeros((3, 2, 15)), cos=torch.zeros((32, 15))),
        "head_dim must be even",
    ),
    "q head_dim stride": (_rotary_args(q=torch.zeros((3, 4, 32))[..., ::2]), "unit stride along head_dim"),
    "k dtype": (_rotary_args(k=torch.zeros((3, 2, 16), dtype=torch.bfloat16)), "share a dtype"),
    "q int": (_rotary_args(q=torch.zeros((3, 4, 16), dtype=torch.int32)), "share a dtype"),
    "positions int32": (_rotary_args(positions=torch.zeros(3, dtype=torch.int32)), r"positions must be int64 \[3\]"),
    "positions length": (_rotary_args(positions=torch.zeros(2, dtype=torch.int64)), r"positions must be int64"),
    "cos head_dim": (_rotary_args(cos=torch.zeros((32, 8))), r"cos must be \[max_positions, 16\]"),
    "sin shape": (_rotary_args(sin=torch.zeros((16, 16))), "sin .* must have cos's shape"),
    "sin dtype": (_rotary_args(sin=torch.zeros((32, 16), dtype=torch.float16)), "sin dtype"),
    "cos stride": (_rotary_args(cos=torch.zeros((32, 32))[:, ::2]), "cos needs unit stride"),
}


@pytest.mark.parametrize("case", sorted(ROTARY_ERRORS))
def test_rotary_rejects(case: str) -> None:
    call, message = ROTARY_ERRORS[case]
    with pytest.raises(ValueError, match=message):
        call()
