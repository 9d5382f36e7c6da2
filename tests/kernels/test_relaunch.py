"""Relaunch: the first launch through Triton's JIT, later ones straight to the compiled kernel (CPU, fakes)."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from triton.compiler import CompiledKernel  # noqa: E402

from slora.kernels.triton.relaunch import LaunchCache, Relaunch  # noqa: E402


class FakeCompiled(CompiledKernel):
    """Stands in for a compiled kernel: records the positional arguments of each direct launch."""

    def __init__(self) -> None:  # no compilation artifacts to load
        self.module = None  # what CompiledKernel.__del__ unloads
        self.launches: list[tuple[tuple[int, ...], list[Any]]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args: self.launches.append((grid, list(args)))


class FakeJit:
    """Stands in for a @triton.jit function with arguments (x_ptr, n, BLOCK)."""

    __name__ = "fake_kernel"
    arg_names = ["x_ptr", "n", "BLOCK"]

    def __init__(self, compiles: bool) -> None:
        self.compiled = FakeCompiled() if compiles else None
        self.jit_launches: list[dict[str, Any]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(**kwargs: Any) -> FakeCompiled | None:
            self.jit_launches.append(kwargs)
            return self.compiled

        return launch


def test_later_launches_go_to_the_compiled_kernel_with_the_new_tensors() -> None:
    kernel = FakeJit(compiles=True)
    first, second = torch.zeros(8), torch.ones(8)
    launch = Relaunch(kernel, (3, 1), {"BLOCK": 16, "x_ptr": first, "n": 8}, {"num_warps": 4}, changing=("x_ptr",))
    launch(first)
    assert [sorted(k) for k in kernel.jit_launches] == [["BLOCK", "n", "num_warps", "x_ptr"]]
    assert launch.compiled
    launch(second)
    assert kernel.compiled is not None
    ((grid, args),) = kernel.compiled.launches
    assert grid == (3, 1, 1) and args[0] is second and args[1:] == [8, 16], "every argument, in the kernel's order"
    assert len(kernel.jit_launches) == 1


def test_a_tensor_of_another_alignment_goes_back_through_the_jit() -> None:
    kernel = FakeJit(compiles=True)
    base = torch.zeros(16)
    launch = Relaunch(kernel, (1,), {"x_ptr": base, "n": 1, "BLOCK": 16}, {}, changing=("x_ptr",))
    launch(base)
    launch(base[1:])  # 4 bytes past a 16-byte boundary: Triton compiles another variant for it
    assert len(kernel.jit_launches) == 2 and kernel.jit_launches[1]["x_ptr"].data_ptr() % 16 == 4
    assert kernel.compiled is not None and not kernel.compiled.launches


def test_without_a_compiled_kernel_every_launch_takes_the_jit() -> None:
    """What TRITON_INTERPRET=1 gives: the interpreter returns no compiled kernel."""
    kernel = FakeJit(compiles=False)
    x = torch.zeros(4)
    launch = Relaunch(kernel, (1,), {"x_ptr": x, "n": 4, "BLOCK": 4}, {}, changing=("x_ptr",))
    launch(x)
    launch(x)
    assert len(kernel.jit_launches) == 2 and not launch.compiled


def test_arguments_must_match_the_kernel() -> None:
    with pytest.raises(ValueError, match=r"fake_kernel: arguments \['n'\] missing, \['m'\] unknown"):
        Relaunch(FakeJit(compiles=True), (1,), {"x_ptr": torch.zeros(1), "m": 1, "BLOCK": 1}, {}, changing=())


def test_a_launch_holds_no_tensor_after_it_returns() -> None:
    kernel = FakeJit(compiles=True)
    x = torch.zeros(4)
    launch = Relaunch(kernel, (1,), {"x_ptr": x, "n": 4, "BLOCK": 4}, {}, changing=("x_ptr",))
    launch(x)
    gone = weakref.ref(x)
    del x
    kernel.jit_launches.clear()
    assert gone() is None, "the launch kept the layer's tensor alive"


def test_cache_reuses_launches_that_differ_only_in_their_tensors() -> None:
    cache = LaunchCache(size=2)
    kernel = FakeJit(compiles=True)
    a, b = torch.zeros(4), torch.ones(4)
    cache(kernel, (2,), a, 4, BLOCK=4, num_warps=1)
    cache(kernel, (2,), b, 4, BLOCK=4, num_warps=1)  # the next layer: same scalars, another tensor
    assert len(kernel.jit_launches) == 1 and kernel.jit_launches[0]["num_warps"] == 1
    assert kernel.compiled is not None and kernel.compiled.launches[0][1][0] is b
    cache(kernel, (2,), a, 5, BLOCK=4, num_warps=1)  # another scalar: another variant's key
    cache(kernel, (2,), a.double(), 4, BLOCK=4, num_warps=1)  # another dtype: another variant
    assert len(kernel.jit_launches) == 3
    cache(kernel, (2,), a, 4, BLOCK=4, num_warps=1)  # the first key was dropped (size 2): through the JIT again
    assert len(kernel.jit_launches) == 4
