"""One Triton kernel launched again and again with the same scalars and grid, only a few tensors changing.

Every layer of a step launches the same LoRA and attention kernels with the same metadata, grids and constexprs;
only the layer's tensors (its activations, its pool layer) change. Triton's `kernel[grid](...)` binds and
specializes all ~25 arguments on every launch, which costs tens of microseconds of host time: an eager step with
prompts launches hundreds of such kernels and spends more time launching them than the GPU spends running them.

A Relaunch goes through Triton's JIT for its first launch (which compiles or finds the variant and returns the
compiled kernel) and calls that compiled kernel directly afterwards. The only part of a variant's key that can
change between its launches is the 16-byte alignment of the changing tensors (Triton specializes pointers on
it), so that is checked on every launch and a change goes back through the JIT. Under TRITON_INTERPRET=1 the JIT
returns no compiled kernel and every launch takes the JIT path.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from triton.compiler import CompiledKernel

POINTER_ALIGN = 16  # bytes: Triton compiles a variant for pointers aligned to this and one for the others


class Relaunch:
    """Launches `kernel` over `grid` with `args` (every kernel argument by name, constexprs included) and
    `options` (num_warps, num_stages), replacing the arguments named in `changing` on each call."""

    def __init__(
        self,
        kernel: Any,
        grid: tuple[int, ...],
        args: dict[str, Any],
        options: dict[str, Any],
        changing: Sequence[str],
    ) -> None:
        names = list(kernel.arg_names)
        missing = set(names) - set(args)
        if missing or set(args) - set(names):
            raise ValueError(
                f"{kernel.__name__}: arguments {sorted(missing)} missing, {sorted(set(args) - set(names))} unknown"
            )
        self._kernel = kernel
        self._grid = tuple(grid) + (1,) * (3 - len(grid))  # the compiled kernel's runner reads three axes
        self._names = names
        self._values = [args[name] for name in names]
        self._options = options
        self._slots = [names.index(name) for name in changing]
        self._runner: Callable[..., None] | None = None  # the compiled kernel's launcher for this grid
        self._aligned = -1  # which changing tensors were 16-byte aligned (one bit each) when it was compiled

    def __call__(self, *tensors: torch.Tensor) -> None:
        values = self._values
        aligned = 0
        for slot, tensor in zip(self._slots, tensors, strict=True):
            values[slot] = tensor
            aligned = aligned << 1 | (tensor.data_ptr() % POINTER_ALIGN == 0)
        try:
            if self._runner is not None and aligned == self._aligned:
                self._runner(*values)
            else:
                self._launch_through_jit(aligned)
        finally:
            for slot in self._slots:  # hold no layer's activations until the next launch
                values[slot] = None

    def _launch_through_jit(self, aligned: int) -> None:
        compiled = self._kernel[self._grid](**dict(zip(self._names, self._values)), **self._options)
        self._runner = compiled[self._grid] if isinstance(compiled, CompiledKernel) else None
        self._aligned = aligned

    @property
    def compiled(self) -> bool:
        """Whether the next launch with equally aligned tensors goes straight to the compiled kernel."""
        return self._runner is not None


OPTIONS = ("num_warps", "num_stages")  # launch options, not kernel arguments


class LaunchCache:
    """Relaunches of small kernels whose every tensor changes between launches (norms, RoPE, K/V writes):
    keyed by the kernel, the grid, the options, every scalar and constexpr and every tensor's dtype, so that a
    launch like an earlier one (the next layer's) goes straight to the compiled kernel. Least recently used
    entries are dropped beyond `size` (grids change with the number of tokens)."""

    def __init__(self, size: int = 256) -> None:
        self._size = size
        self._launches: OrderedDict[tuple[Any, ...], Relaunch] = OrderedDict()

    def __call__(self, kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        """Like kernel[grid](*args, **kwargs), tensors given by position."""
        parts: list[Any] = [kernel, grid]
        tensors = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                tensors.append(arg)
                parts.append(arg.dtype)
            else:
                parts.append(arg)
        key = (*parts, *kwargs.items())
        launch = self._launches.get(key)
        if launch is None:
            launch = self._launches[key] = self._build(kernel, grid, args, kwargs)
            if len(self._launches) > self._size:
                self._launches.popitem(last=False)
        else:
            self._launches.move_to_end(key)
        launch(*tensors)

    @staticmethod
    def _build(kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Relaunch:
        if any(isinstance(value, torch.Tensor) for value in kwargs.values()):
            raise ValueError(f"{kernel.__name__}: give tensors by position (a keyword tensor would key the cache)")
        named = dict(zip(kernel.arg_names, args))
        named.update(kwargs)
        options = {name: named.pop(name) for name in OPTIONS if name in named}
        tensors = tuple(name for name, value in named.items() if isinstance(value, torch.Tensor))
        return Relaunch(kernel, grid, named, options, tensors)


launch_cached = LaunchCache()
