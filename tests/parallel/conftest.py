"""The session's Llama and Qwen2 with two more adapters beside MIXED_ADAPTERS: rank 64 on every projection and an
odd rank (33) on the MLP, which the ranks split unevenly (padded to a multiple of tensor_parallel_size)."""

from __future__ import annotations

import shutil

import pytest

from tests.factories import ALL_MODULES, AdapterSpec, save_adapter
from tests.model_fixtures import ModelWithAdapters

WIDE_ADAPTERS = (
    AdapterSpec("r64-all", 64, ALL_MODULES, alpha=32, rslora=True),
    AdapterSpec("r33-mlp", 33, ("gate_proj", "up_proj", "down_proj"), alpha=20),
)


def _widened(model: ModelWithAdapters, tmp_path_factory: pytest.TempPathFactory, seed: int) -> ModelWithAdapters:
    """A root of its own (other tests list the shared one): copies of the mixed adapters, and the wide ones."""
    root = tmp_path_factory.mktemp("wide-adapters")
    for name in model.adapters:
        shutil.copytree(model.adapter_root / name, root / name)
    for i, spec in enumerate(WIDE_ADAPTERS):
        save_adapter(model.base, spec, root, seed=seed + i)
    return ModelWithAdapters(model.base, root, (*model.adapters, *(s.name for s in WIDE_ADAPTERS)))


@pytest.fixture(scope="session")
def llama_wide(llama: ModelWithAdapters, tmp_path_factory: pytest.TempPathFactory) -> ModelWithAdapters:
    return _widened(llama, tmp_path_factory, seed=900)


@pytest.fixture(scope="session")
def qwen2_wide(qwen2: ModelWithAdapters, tmp_path_factory: pytest.TempPathFactory) -> ModelWithAdapters:
    return _widened(qwen2, tmp_path_factory, seed=950)
