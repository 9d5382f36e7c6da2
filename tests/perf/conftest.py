"""Tiny model and adapters on disk, shared by the perf smoke tests (built once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

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
