"""Run Python without the triton package, as after `pip install .[serve]`, without a second environment.

A folder holding a `triton` package whose import fails the way a missing package does (ModuleNotFoundError naming
triton) goes first on PYTHONPATH, which every process started from it inherits (slora-serve, the engine process),
and on SLORA_STUB_PYTHONPATH, which Triton's Python-backend stub puts first on its own path (model.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BLOCKER = 'raise ModuleNotFoundError("No module named \'triton\' (blocked by tests/packaging)", name="triton")\n'
REPO = Path(__file__).resolve().parents[2]


def blocked_environment(root: Path) -> dict[str, str]:
    """os.environ with a triton blocker under `root` first on PYTHONPATH and SLORA_STUB_PYTHONPATH, the checkout
    after it (so that `-m tests.packaging...` resolves in any working directory)."""
    package = root / "no-triton" / "triton"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(BLOCKER)
    env = dict(os.environ)
    for name, extra in (("PYTHONPATH", [str(REPO)]), ("SLORA_STUB_PYTHONPATH", [])):
        env[name] = os.pathsep.join([str(package.parent), *extra, *filter(None, [env.get(name)])])
    return env


def run_without_triton(root: Path, *args: str, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
    """`python *args` in the blocked environment, from the checkout; output captured as text."""
    return subprocess.run(
        [sys.executable, *args], env=blocked_environment(root), cwd=REPO, capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip
