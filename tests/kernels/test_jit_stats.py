"""The compile counter the benchmarks record: it reads Triton's per-device kernel caches, whatever their tuple."""

from __future__ import annotations

import importlib
import pkgutil
import types
from typing import Any

import pytest

import slora.kernels.triton as triton_kernels
from slora.kernels.triton import jit_stats


def test_counts_every_cached_variant_across_devices() -> None:
    kernel = types.SimpleNamespace(device_caches={0: ({"k1": 1, "k2": 2}, {}, "t", "b", "bind"), 1: ({"k3": 3},)})
    assert len(jit_stats._cache_keys(kernel)) == 3


def test_unknown_layouts_and_interpreted_kernels_count_zero() -> None:
    assert jit_stats._cache_keys(types.SimpleNamespace()) == []
    assert jit_stats._cache_keys(types.SimpleNamespace(device_caches={0: "not a tuple"})) == []


def test_every_project_kernel_is_listed() -> None:
    counts = jit_stats.compiled_variants()
    assert set(counts) == {name for _, name in jit_stats.KERNELS}
    assert all(n >= 0 for n in counts.values())


def test_no_project_kernel_is_left_out() -> None:
    """Every Triton kernel of slora.kernels.triton (a module-level `_..._kernel` jit function) is counted."""
    found = set()
    for info in pkgutil.iter_modules(triton_kernels.__path__):
        module = importlib.import_module(f"slora.kernels.triton.{info.name}")
        for name, value in vars(module).items():
            if name.startswith("_") and name.endswith("_kernel") and hasattr(value, "arg_names"):
                found.add((module.__name__, name))
    assert found and found <= set(jit_stats.KERNELS), found - set(jit_stats.KERNELS)


def test_keys_since_names_the_new_specializations(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = types.SimpleNamespace(device_caches={0: ({"(16, 'fp16')": 1, "(1, 'fp16')": 2}, {}), 1: ({"(8,)": 3},)})
    assert sorted(jit_stats._cache_keys(kernel)) == ["(1, 'fp16')", "(16, 'fp16')", "(8,)"]
    now = {"_a_kernel": {"x", "y", "v"}, "_b_kernel": {"z"}, "_c_kernel": {"w"}}
    monkeypatch.setattr(jit_stats, "variant_keys", lambda: now)
    assert jit_stats.keys_since({"_a_kernel": {"x"}, "_b_kernel": {"z"}}) == {
        "_a_kernel": ["v", "y"],
        "_c_kernel": ["w"],
    }


def test_kernels_replaced_stands_in_for_every_kernel_and_puts_them_back() -> None:
    def current() -> dict[str, Any]:
        return {(module, name): getattr(importlib.import_module(module), name) for module, name in jit_stats.KERNELS}

    before = current()
    with jit_stats.kernels_replaced(lambda kernel: ("stand-in", kernel)):
        assert current() == {key: ("stand-in", kernel) for key, kernel in before.items()}
    assert current() == before


# Integer arguments of the LoRA kernels (and the projection GEMM's row count) whose values follow the step (its
# tokens, its adapters' ranks, its split):
# specialized, each new divisibility class would compile a variant while serving.
STEP_DEPENDENT = {
    "_lora_shrink_kernel": {"stride_v_split", "stride_v_tok"},
    "_lora_shrink_gemv_kernel": {"stride_v_split", "stride_v_tok"},
    "_lora_expand_kernel": {"stride_v_tok"},  # reads one split of v: the tensor-core shrink sums them
    "_lora_expand_gemv_kernel": {"split_k", "stride_v_split", "stride_v_tok"},
    "_gemm_kernel": {"M"},
}


@pytest.mark.parametrize("kernel_name", sorted(STEP_DEPENDENT))
def test_step_dependent_arguments_are_not_specialized(kernel_name: str) -> None:
    module = dict((name, module) for module, name in jit_stats.KERNELS)[kernel_name]
    kernel = getattr(importlib.import_module(module), kernel_name)
    if hasattr(kernel, "params"):  # compiled: triton.jit's JITFunction
        unspecialized = {p.name for p in kernel.params if p.do_not_specialize}
    else:  # under TRITON_INTERPRET=1: the interpreter keeps triton.jit's arguments
        unspecialized = set(kernel.kwargs["do_not_specialize"] or ())
    assert STEP_DEPENDENT[kernel_name] <= unspecialized, STEP_DEPENDENT[kernel_name] - unspecialized


def test_compiled_kernels_are_the_caches_values_on_every_device() -> None:
    kernel = types.SimpleNamespace(device_caches={0: ({"k1": "c1"}, {}), 1: ({"k2": "c2", "k3": "c3"},), 2: "odd"})
    assert sorted(jit_stats.compiled_kernels(kernel)) == ["c1", "c2", "c3"]
    assert jit_stats.compiled_kernels(types.SimpleNamespace()) == []
