"""Tiny model and adapters on disk, shared by the perf smoke tests (built once per session)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from perf.make_adapters import SETTINGS, make_adapters
from perf.make_model import SHAPES, write_model_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(SHAPES["tiny"], tmp_path_factory.mktemp("perf") / "model")


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model: Path) -> Path:
    root = tiny_model.parent / "adapters"
    for setting in ("S1", "S2", "Sall"):
        make_adapters(tiny_model, SETTINGS[setting], n=6, out=root, distinct=2)
    return root


@pytest.fixture(scope="package", autouse=True)
def one_intra_op_thread() -> Iterator[None]:
    """The engine on a small shared CPU: two spinning intra-op threads make steps up to 10x slower and erratic."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
