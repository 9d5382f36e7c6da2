"""Session-wide checkpoints with mixed adapters (GQA Llama, Llama-3 scaling, Qwen2 with qkv bias, sharded Mistral),
and the places the engine runs here: fixtures for every test package (registered by tests/conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.factories import (
    MIXED_ADAPTERS,
    save_adapter,
    save_random_model,
    tiny_llama_config,
    tiny_mistral_config,
    tiny_qwen2_config,
)


@dataclass(frozen=True)
class ModelWithAdapters:
    base: Path
    adapter_root: Path
    adapters: tuple[str, ...]


def _build(root: Path, config: object, seed: int, max_shard_size: str | None = None) -> ModelWithAdapters:
    base = save_random_model(config, root / "base", seed=seed, max_shard_size=max_shard_size)
    adapters = root / "adapters"
    for i, spec in enumerate(MIXED_ADAPTERS):
        save_adapter(base, spec, adapters, seed=seed * 100 + i)
    return ModelWithAdapters(base, adapters, tuple(s.name for s in MIXED_ADAPTERS))


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> ModelWithAdapters:
    return _build(tmp_path_factory.mktemp("llama"), tiny_llama_config(), seed=1)


@pytest.fixture(scope="session")
def llama3_scaled(tmp_path_factory: pytest.TempPathFactory) -> ModelWithAdapters:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    config = tiny_llama_config(rope_parameters=rope, tie_word_embeddings=True, max_position_embeddings=1024)
    return _build(tmp_path_factory.mktemp("llama3"), config, seed=2)


@pytest.fixture(scope="session")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> ModelWithAdapters:
    return _build(tmp_path_factory.mktemp("qwen2"), tiny_qwen2_config(), seed=3)


@pytest.fixture(scope="session")
def qwen2_wide_mlp(tmp_path_factory: pytest.TempPathFactory) -> ModelWithAdapters:
    """Qwen2 as Qwen2.5-7B is laid out: one KV head for a wide MLP, so that a page of 16 tokens (512 elements)
    cannot hold an MLP adapter row (640)."""
    return _build(tmp_path_factory.mktemp("qwen2-wide"), tiny_qwen2_config(intermediate_size=640), seed=5)


@pytest.fixture(scope="session")
def mistral_sharded(tmp_path_factory: pytest.TempPathFactory) -> ModelWithAdapters:
    """Mistral (explicit head_dim, sliding window) saved as several safetensors shards with an index."""
    return _build(tmp_path_factory.mktemp("mistral"), tiny_mistral_config(), seed=4, max_shard_size="100KB")


def _targets() -> list[tuple[str, str]]:
    import torch

    targets = [("cpu", "torch")]
    if torch.cuda.is_available():
        targets += [("cuda", "torch"), ("cuda", "triton")]
    return targets


TARGETS = _targets()


@pytest.fixture(params=TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
def target(request: pytest.FixtureRequest) -> dict[str, str]:
    """Engine options for each place the engine runs here: CPU torch, and on CUDA machines torch and Triton.

    float32, so that greedy tokens can be compared exactly (outside near ties) with HF in float32.
    """
    device, backend = request.param
    return {"device": device, "kernel_backend": backend, "dtype": "float32"}
