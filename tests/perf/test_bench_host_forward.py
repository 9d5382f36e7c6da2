"""perf/bench_host_forward.py on the tiny model: eager decode and mixed steps run on the Triton ops with every
kernel's launch stubbed, are timed, and the real kernels are back afterwards."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from perf import bench_host_forward  # noqa: E402
from slora.kernels.triton import norm  # noqa: E402
from slora.kernels.triton.jit_stats import KERNELS  # noqa: E402
from slora.kernels.triton.relaunch import Relaunch  # noqa: E402


def test_eager_steps_are_timed_with_stubbed_kernels(tiny_model: Path, tiny_adapters: Path, tmp_path: Path) -> None:
    before = {(module, name): getattr(importlib.import_module(module), name) for module, name in KERNELS}
    out = tmp_path / "forward.json"
    results = bench_host_forward.main(["--model", str(tiny_model), "--adapter-root", str(tiny_adapters),
                                       "--seqs", "6", "--prompt-len", "20", "--steps", "3", "--repeats", "2",
                                       "--out", str(out)])  # fmt: skip
    assert [r.kind for r in results] == ["decode", "mixed"]
    for r in results:
        assert r.seqs == 6 and r.layers == 2 and len(r.repeats_ms) == 2 and all(t > 0 for t in r.repeats_ms)
        assert r.per_layer_us == pytest.approx(1000 * r.median_ms / r.layers)
    assert [entry["kind"] for entry in json.loads(out.read_text())] == ["decode", "mixed"]
    after = {(module, name): getattr(importlib.import_module(module), name) for module, name in KERNELS}
    assert after == before, "the real kernels are restored"


def test_a_stubbed_launch_reaches_the_compiled_path() -> None:
    """The stand-in returns a compiled kernel, so Relaunch takes the direct path the GPU takes."""
    with bench_host_forward.stubbed_kernels():
        stub = norm._rms_norm_kernel
        assert isinstance(stub, bench_host_forward.StubKernel)
        x = torch.zeros(2, 4)
        args = dict(x_ptr=x, stride_x=4, residual_ptr=x, stride_residual=0, weight_ptr=x, out_ptr=x, s_ptr=x,
                    eps=1e-5, HIDDEN=4, HAS_RESIDUAL=False, BLOCK=4)  # fmt: skip
        launch = Relaunch(stub, (2,), args, {}, ("x_ptr",))
        launch(x)
        assert launch.compiled
