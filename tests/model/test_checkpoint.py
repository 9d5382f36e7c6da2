"""Base checkpoints: what is refused, and how the context is bounded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.errors import ModelLoadError
from tests.model_fixtures import ModelWithAdapters


def _copy_base(model: ModelWithAdapters, tmp_path: Path) -> Path:
    dst = tmp_path / "base"
    shutil.copytree(model.base, dst)
    return dst


def test_pickle_only_checkpoint_refused(llama: ModelWithAdapters, tmp_path: Path) -> None:
    base = _copy_base(llama, tmp_path)
    (base / "model.safetensors").rename(base / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pickle files are never loaded"):
        LLMEngine(EngineConfig(model=str(base)))


def test_missing_and_misshapen_tensors_named(llama: ModelWithAdapters, tmp_path: Path) -> None:
    base = _copy_base(llama, tmp_path)
    tensors = load_file(str(base / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(base / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight' is missing"):
        LLMEngine(EngineConfig(model=str(base)))
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"].clone()
    save_file(tensors, str(base / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="has shape"):
        LLMEngine(EngineConfig(model=str(base)))


def test_unsupported_architecture_and_rope_named(llama: ModelWithAdapters, tmp_path: Path) -> None:
    base = _copy_base(llama, tmp_path)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        LLMEngine(EngineConfig(model=str(base)))
    yarn = {**config, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}
    (base / "config.json").write_text(json.dumps(yarn))
    with pytest.raises(ModelLoadError, match="rope type 'yarn'"):
        LLMEngine(EngineConfig(model=str(base)))


def test_sliding_window_bounds_the_context(mistral_sharded: ModelWithAdapters) -> None:
    engine = LLMEngine(EngineConfig(model=str(mistral_sharded.base), pool_bytes=1 << 20))
    assert engine.max_model_len == 64
    with pytest.raises(ValueError, match="exceeds the model's context"):
        LLMEngine(EngineConfig(model=str(mistral_sharded.base), pool_bytes=1 << 20, max_model_len=100))


def test_dummy_weights_need_only_a_config(llama: ModelWithAdapters, tmp_path: Path) -> None:
    (tmp_path / "cfg").mkdir()
    shutil.copy(llama.base / "config.json", tmp_path / "cfg" / "config.json")
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "cfg"), load_format="dummy", pool_bytes=1 << 20))
    [out] = engine.generate([[1, 2, 3]], None, None)
    assert len(out.token_ids) >= 1
