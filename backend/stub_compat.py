"""Environment checks for Triton's Python-backend stub (server 2.51 = container 24.10).

That stub is built with pybind11 against NumPy 1. Under NumPy 2 the array descriptor's layout differs, the stub
builds every input array with a zero stride, and each input arrives as its first byte repeated (seen on the GPU
host: a BYTES adapter id read with the length 0x07070707, then a crash of the stub). nvidia-pytriton pins numpy<2
for the same reason. Refuse to start rather than serve corrupted inputs.

An environment whose own packages need NumPy 2 (the GPU host's) can still serve: `SLORA_STUB_PYTHONPATH` names
folders that the model.py shims put first on the stub's sys.path (the stub ignores PYTHONPATH), say one holding
numpy 1.26, so the launcher and every other process keep NumPy 2. Inside the stub, compiled packages built for
NumPy 2 then fail to import; scikit-learn is the one transformers imports on its own, so it is hidden there
(transformers runs without it).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

logger = logging.getLogger(__name__)

ALLOW_ENV = "SLORA_ALLOW_NUMPY2"  # for a server whose stub is built against NumPy 2
STUB_PATH_ENV = "SLORA_STUB_PYTHONPATH"  # folders first on the stub's module path (and nowhere else)
OPTIONAL_PACKAGES = ("sklearn", "scipy")  # imported by transformers when present, not needed by slora


def numpy_problem(version: str | None = None) -> str | None:
    """A message when NumPy `version` (default: the one imported here) breaks the stub's inputs, else None."""
    if version is None:
        import numpy

        version = numpy.__version__
    if _major(version) < 2 or os.environ.get(ALLOW_ENV) == "1":
        return None
    return (
        f"NumPy {version} is what the Python-backend stub would import, but Triton 2.51's stub is built against "
        "NumPy 1 and corrupts every input tensor under NumPy 2: install numpy<2 (pip install 'numpy<2'), or put a "
        f"folder holding numpy<2 in {STUB_PATH_ENV} (for the stub only), or set {ALLOW_ENV}=1 for a server whose "
        "stub is built against NumPy 2"
    )


def stub_first_paths() -> list[str]:
    """The folders of SLORA_STUB_PYTHONPATH, which the model.py shims put first on the stub's sys.path."""
    return [d for d in os.environ.get(STUB_PATH_ENV, "").split(os.pathsep) if d]


def stub_numpy_version(env: dict[str, str]) -> str:
    """The NumPy version the stub will import: a process started with `env`, with the shims' sys.path first."""
    script = "import sys; sys.path[:0] = sys.argv[1:]; import numpy; print(numpy.__version__)"
    result = subprocess.run(
        [sys.executable, "-c", script, *stub_first_paths()],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"NumPy cannot be imported with the stub's module path: {result.stderr.strip()[-500:]}")
    return result.stdout.strip()


def hide_packages_broken_by_numpy() -> list[str]:
    """Under NumPy 1, hide optional packages built for NumPy 2 that fail to import; returns the hidden names.

    transformers imports scikit-learn (and through it SciPy) whenever it is installed; a build for NumPy 2 fails
    under NumPy 1 part-way through its import. Marking it absent in sys.modules makes transformers skip it.
    """
    import numpy

    if _major(numpy.__version__) >= 2:
        return []
    try:
        import sklearn.metrics  # noqa: F401
    except ModuleNotFoundError:
        return []
    except Exception as exc:  # noqa: BLE001 - any failure inside its import means the build does not fit NumPy 1
        for name in [m for m in sys.modules if m.split(".")[0] in OPTIONAL_PACKAGES]:
            del sys.modules[name]
        for name in OPTIONAL_PACKAGES:
            sys.modules[name] = None  # type: ignore[assignment]
        logger.warning(
            "scikit-learn/SciPy do not import under NumPy %s (%s: %s); hidden from this process",
            numpy.__version__, type(exc).__name__, exc,
        )  # fmt: skip
        return list(OPTIONAL_PACKAGES)
    return []


def _major(version: str) -> int:
    return int(version.split(".")[0])


def prepare_stub() -> None:
    """What every slora model does first inside the stub: refuse NumPy 2, hide packages that need it."""
    problem = numpy_problem()
    if problem:
        raise RuntimeError(problem)
    hide_packages_broken_by_numpy()
