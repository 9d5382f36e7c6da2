"""An adapter described from its config and safetensors header equals it read in full, and is refused alike."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from slora.backend.adapters.describe import describe_peft_adapter, read_header
from slora.backend.adapters.host_adapter import load_peft_adapter
from slora.backend.errors import AdapterError
from slora.backend.memory.page_pool import PoolGeometry
from slora.backend.model.spec import ModelSpec
from tests.model_fixtures import ModelWithAdapters


def _spec_and_geometry(model: ModelWithAdapters, page_size: int) -> tuple[ModelSpec, PoolGeometry]:
    spec = ModelSpec.from_dir(model.base)
    return spec, PoolGeometry(spec.num_layers, page_size, spec.num_kv_heads, spec.head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [4, 16])
def test_described_ref_equals_the_loaded_adapters(
    llama: ModelWithAdapters, qwen2: ModelWithAdapters, dtype: torch.dtype, page_size: int
) -> None:
    for model in (llama, qwen2):
        spec, geometry = _spec_and_geometry(model, page_size)
        for name in model.adapters:
            path = model.adapter_root / name
            described = describe_peft_adapter(name, path, spec, geometry, dtype, generation=3)
            loaded = load_peft_adapter(name, path, spec, geometry, dtype, generation=3)
            assert described == loaded.ref, name


def _copy(model: ModelWithAdapters, tmp_path: Path, name: str = "r1-qv") -> Path:
    return Path(shutil.copytree(model.adapter_root / name, tmp_path / name))


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))


def _rewrite(path: Path, change) -> None:  # type: ignore[no-untyped-def]
    tensors = load_file(str(path / "adapter_model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "adapter_model.safetensors"))


MUTATIONS = {
    "no config": lambda p: (p / "adapter_config.json").unlink(),
    "bad json": lambda p: (p / "adapter_config.json").write_text("{nope"),
    "no weights": lambda p: (p / "adapter_model.safetensors").unlink(),
    "pickle": lambda p: (p / "adapter_model.safetensors").rename(p / "adapter_model.bin"),
    "garbage": lambda p: (p / "adapter_model.safetensors").write_bytes(b"garbage"),
    "ia3": lambda p: _edit_config(p, peft_type="IA3"),
    "nan alpha": lambda p: _edit_config(p, lora_alpha=float("nan")),
    "huge alpha": lambda p: _edit_config(p, lora_alpha=1e300),
    "lm_head": lambda p: _rewrite(p, lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.ones(1, 64)})),
    "short A": lambda p: _rewrite(p, lambda t: t.update({k: v[:, :10] for k, v in t.items() if "lora_A" in k})),
    "no B": lambda p: _rewrite(p, lambda t: [t.pop(k) for k in list(t) if "q_proj.lora_B" in k]),
    "layer 9": lambda p: _rewrite(
        p, lambda t: t.update({k.replace("layers.0", "layers.9"): v.clone() for k, v in list(t.items())})
    ),
    "int weights": lambda p: _rewrite(p, lambda t: t.update({k: v.to(torch.int32) for k, v in t.items()})),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_refused_as_a_full_read_refuses(llama: ModelWithAdapters, tmp_path: Path, mutation: str) -> None:
    spec, geometry = _spec_and_geometry(llama, 8)
    path = _copy(llama, tmp_path)
    MUTATIONS[mutation](path)
    with pytest.raises(AdapterError) as full:
        load_peft_adapter("bad-one", path, spec, geometry, torch.float32)
    with pytest.raises(AdapterError) as described:
        describe_peft_adapter("bad-one", path, spec, geometry, torch.float32)
    if mutation == "int weights":  # the dtype's name differs: torch's against safetensors'
        assert "2-D floating-point matrix" in str(full.value) and "I32" in str(described.value)
    elif mutation == "garbage":  # safetensors' own reason against the header's
        assert "cannot be read as safetensors" in str(described.value)
    else:
        assert str(described.value) == str(full.value)


def test_nan_weights_pass_the_header_and_fail_the_full_read(llama: ModelWithAdapters, tmp_path: Path) -> None:
    spec, geometry = _spec_and_geometry(llama, 8)
    path = _copy(llama, tmp_path)
    _rewrite(path, lambda t: t.update({k: v.clone().fill_(float("nan")) for k, v in t.items() if "lora_B" in k}))
    assert describe_peft_adapter("nan", path, spec, geometry, torch.float32).num_pages > 0
    with pytest.raises(AdapterError, match="NaN or infinite"):
        load_peft_adapter("nan", path, spec, geometry, torch.float32)


def test_a_truncated_file_is_refused_from_its_header(llama: ModelWithAdapters, tmp_path: Path) -> None:
    path = _copy(llama, tmp_path)
    weights = path / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-8])
    with pytest.raises(AdapterError, match="beyond the end of the file"):
        read_header("cut", weights)
    (length,) = struct.unpack("<Q", data[:8])
    weights.write_bytes(data[: 8 + length // 2])
    with pytest.raises(AdapterError, match="ends inside its header"):
        read_header("cut", weights)
