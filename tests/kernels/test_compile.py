"""Every kernel launch of real-shaped steps compiles for sm_90 (H100/H200), checked on any machine.

See sm90_compile.py; each scenario runs in a fresh process without TRITON_INTERPRET.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from tests.kernels.sm90_compile import SCENARIOS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NO_TOOLCHAIN = 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine compiles and runs every kernel for real")
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_launches_compile_for_sm90(scenario: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "tests.kernels.sm90_compile", scenario]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode == NO_TOOLCHAIN:
        pytest.skip(f"this machine cannot compile for sm_90: {done.stderr[-500:]}")
    assert done.returncode == 0, done.stderr[-4000:]
