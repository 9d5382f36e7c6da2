"""The project's Triton kernels: how many variants of each have been compiled in this process, and a way to stand
in for all of them at once (kernels_replaced, for benchmarks and tests that time or record launches).

Triton compiles a kernel once per specialization (constexprs, integer-argument classes, dtypes). A compile inside
a measured run stalls it for far longer than a step, so the benchmarks record this count before and after each run:
a non-zero difference means the warm-up missed a launch shape. Reads Triton's per-device kernel caches; where
the Triton version lays them out differently, or under the interpreter (nothing is compiled), it counts 0.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

KERNELS = (  # (module, kernel)
    ("slora.kernels.triton.activation", "_silu_mul_kernel"),
    ("slora.kernels.triton.decode_reduce", "_decode_reduce_kernel"),
    ("slora.kernels.triton.kv_write", "_kv_write_kernel"),
    ("slora.kernels.triton.lora_expand", "_lora_expand_kernel"),
    ("slora.kernels.triton.lora_expand", "_lora_expand_gemv_kernel"),
    ("slora.kernels.triton.lora_fused", "_lora_fused_kernel"),
    ("slora.kernels.triton.gemm", "_gemm_kernel"),
    ("slora.kernels.triton.lora_shrink", "_lora_shrink_kernel"),
    ("slora.kernels.triton.lora_shrink", "_lora_shrink_gemv_kernel"),
    ("slora.kernels.triton.norm", "_rms_norm_kernel"),
    ("slora.kernels.triton.paged_attention", "_paged_attention_kernel"),
    ("slora.kernels.triton.paged_decode", "_paged_decode_kernel"),
    ("slora.kernels.triton.rotary", "_rotary_kernel"),
)


def compiled_variants() -> dict[str, int]:
    """Kernel name → compiled variants so far, for the kernels whose modules are imported."""
    return {name: len(keys) for name, keys in variant_keys().items()}


def variant_keys() -> dict[str, set[str]]:
    """Kernel name → the specialization key of each compiled variant (what tells two variants apart: constexprs,
    integer-argument classes, dtypes), for the kernels whose modules are imported."""
    keys = {}
    for module_name, kernel_name in KERNELS:
        try:
            kernel = getattr(importlib.import_module(module_name), kernel_name)
        except ImportError:
            continue
        keys[kernel_name] = {str(key) for key in _cache_keys(kernel)}
    return keys


def compiled_kernels(kernel: Any) -> list[Any]:
    """The compiled variants of one kernel so far (Triton's compiled kernels, with their metadata), on every
    device; none under the interpreter or an unknown cache layout."""
    return [compiled for cache in _kernel_caches(kernel) for compiled in cache.values()]


def _cache_keys(kernel: Any) -> list[Any]:
    return [key for cache in _kernel_caches(kernel) for key in cache]


def _kernel_caches(kernel: Any) -> list[dict[Any, Any]]:
    caches = getattr(kernel, "device_caches", None)
    if not isinstance(caches, dict):
        return []
    # the kernel cache comes first in triton 3.x's per-device tuple
    return [entry[0] for entry in caches.values() if isinstance(entry, tuple) and entry and isinstance(entry[0], dict)]


def keys_since(before: dict[str, set[str]]) -> dict[str, list[str]]:
    """Kernel name → the keys of the variants compiled since `before` (a variant_keys() result), for those that
    compiled: which specialization a warm-up missed."""
    new = {name: keys - before.get(name, set()) for name, keys in variant_keys().items()}
    return {name: sorted(keys) for name, keys in new.items() if keys}


@contextlib.contextmanager
def kernels_replaced(make: Callable[[Any], Any]) -> Iterator[None]:
    """Every kernel of KERNELS replaced by make(kernel) for the duration, then put back. The launchers look their
    kernel up in its module at each call, so they launch the stand-in."""
    originals = {(module, name): getattr(importlib.import_module(module), name) for module, name in KERNELS}
    for (module, name), kernel in originals.items():
        setattr(importlib.import_module(module), name, make(kernel))
    try:
        yield
    finally:
        for (module, name), kernel in originals.items():
            setattr(importlib.import_module(module), name, kernel)
