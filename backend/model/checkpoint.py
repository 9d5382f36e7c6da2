"""Load a Hugging Face checkpoint directory (config.json + *.safetensors, sharded or not) into ModelWeights.

Pickle checkpoints (*.bin, *.pt) are refused: they can run code when unpickled.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from slora.backend.errors import ModelLoadError
from slora.backend.model.spec import ModelSpec
from slora.backend.model.weights import LayerWeights, ModelWeights

logger = logging.getLogger(__name__)

TensorSource = Callable[[str], torch.Tensor]


def load_checkpoint(path: str | Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> ModelWeights:
    """Read every tensor the architecture needs, check its shape, cast to `dtype` and move to `device`."""
    path = Path(path)
    files = _safetensors_files(path)
    index = _tensor_index(files)
    logger.info("loading %d safetensors file(s) from %s", len(files), path)

    def read(name: str) -> torch.Tensor:
        for candidate in (name, name.removeprefix("model.")):
            if candidate in index:
                with safe_open(str(index[candidate]), framework="pt") as handle:
                    return handle.get_tensor(candidate).to(dtype=dtype, device=device)
        raise ModelLoadError(f"{path}: tensor {name!r} is missing from the checkpoint")

    return assemble_weights(read, spec, source=str(path))


def random_weights(spec: ModelSpec, dtype: torch.dtype, device: torch.device, seed: int = 0) -> ModelWeights:
    """Random weights of the right shapes (for benchmarks of large shapes without a checkpoint on disk).

    Drawn on `device` (a 7B model takes seconds on a GPU, minutes on one CPU core).
    """
    generator = torch.Generator(device=device).manual_seed(seed)

    def read(name: str) -> torch.Tensor:
        shape = _expected_shape(name, spec)
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype, device=device)
        values = torch.randn(shape, generator=generator, dtype=dtype, device=device)
        return values.mul_(1.0 / shape[-1] ** 0.5)

    return assemble_weights(read, spec, source="random")


def assemble_weights(read: TensorSource, spec: ModelSpec, source: str) -> ModelWeights:
    def get(name: str) -> torch.Tensor:
        tensor = read(name)
        expected = _expected_shape(name, spec)
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
        return tensor

    layers = [_layer(get, spec, i) for i in range(spec.num_layers)]
    embed = get("model.embed_tokens.weight")
    lm_head = embed if spec.tie_word_embeddings else get("lm_head.weight")
    return ModelWeights(embed=embed, layers=layers, final_norm=get("model.norm.weight"), lm_head=lm_head)


def _layer(get: TensorSource, spec: ModelSpec, i: int) -> LayerWeights:
    p = f"model.layers.{i}."
    qkv = torch.cat([get(p + f"self_attn.{m}.weight") for m in ("q_proj", "k_proj", "v_proj")])
    bias = None
    if spec.qkv_bias:
        bias = torch.cat([get(p + f"self_attn.{m}.bias") for m in ("q_proj", "k_proj", "v_proj")])
    gate_up = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
    return LayerWeights(
        input_norm=get(p + "input_layernorm.weight"),
        qkv=qkv,
        qkv_bias=bias,
        o=get(p + "self_attn.o_proj.weight"),
        post_norm=get(p + "post_attention_layernorm.weight"),
        gate_up=gate_up,
        down=get(p + "mlp.down_proj.weight"),
    )


def _expected_shape(name: str, spec: ModelSpec) -> tuple[int, ...]:
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (spec.vocab_size, spec.hidden_size)
    if name.endswith("norm.weight"):
        return (spec.hidden_size,)
    module, kind = name.split(".")[-2:]
    in_features, out_features = spec.module_shape(module)
    return (out_features,) if kind == "bias" else (out_features, in_features)


def _safetensors_files(path: Path) -> list[Path]:
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a directory (a model is a directory with config.json and *.safetensors)")
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    if pickles:
        raise ModelLoadError(
            f"{path}: only pickle weights found ({', '.join(pickles)}); pickle files are never loaded, "
            "convert the checkpoint to safetensors"
        )
    raise ModelLoadError(f"{path}: no *.safetensors files")


def _tensor_index(files: list[Path]) -> dict[str, Path]:
    index_file = files[0].parent / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text()).get("weight_map", {})
        return {name: index_file.parent / shard for name, shard in weight_map.items()}
    index: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                index[name] = file
    return index
