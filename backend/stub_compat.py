"""Environment checks for Triton's Python-backend stub (server 2.51 = container 24.10).

That stub is built with pybind11 against NumPy 1. Under NumPy 2 the array descriptor's layout differs, the stub
builds every input array with a zero stride, and each input arrives as its first byte repeated (seen on the GPU
host: a BYTES adapter id read with the length 0x07070707, then a crash of the stub). nvidia-pytriton pins numpy<2
for the same reason. Refuse to start rather than serve corrupted inputs.
"""

from __future__ import annotations

import os

ALLOW_ENV = "SLORA_ALLOW_NUMPY2"  # for a server whose stub is built against NumPy 2


def numpy_problem() -> str | None:
    """A message when the installed NumPy breaks the stub's inputs, else None."""
    import numpy

    major = int(numpy.__version__.split(".")[0])
    if major < 2 or os.environ.get(ALLOW_ENV) == "1":
        return None
    return (
        f"NumPy {numpy.__version__} is installed, but Triton 2.51's Python-backend stub is built against NumPy 1 "
        "and corrupts every input tensor under NumPy 2: install numpy<2 (pip install 'numpy<2'), or set "
        f"{ALLOW_ENV}=1 for a server whose stub is built against NumPy 2"
    )
