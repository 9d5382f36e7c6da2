"""Demo PEFT LoRA adapters for a base model: small random weights, so outputs stay coherent but differ.

    python -m slora.backend.adapters.demo --model default --out .cache/demo-adapters

Writes <out>/<name>/{adapter_config.json, adapter_model.safetensors} for a few ranks and target sets, in the
format PEFT saves (and loads). Deterministic: the same model and name give the same weights. Adapters already
present are left alone (unless --force).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from slora.backend.adapters.host_adapter import CONFIG_FILE, WEIGHTS_FILE
from slora.backend.model.default_model import resolve_model_path
from slora.backend.model.spec import ModelSpec

logger = logging.getLogger(__name__)

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
_PARENT = {**{m: "self_attn" for m in ATTENTION}, **{m: "mlp" for m in MLP}}


@dataclass(frozen=True)
class DemoAdapter:
    name: str
    rank: int
    targets: tuple[str, ...]
    alpha: float
    strength: float  # std of lora_B, relative to 1/sqrt(rank)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")
        unknown = set(self.targets) - set(_PARENT)
        if unknown:
            raise ValueError(f"unknown target modules {sorted(unknown)}")


DEMO_ADAPTERS = (
    DemoAdapter("demo-qv-r4", 4, ("q_proj", "v_proj"), alpha=8, strength=0.08),
    DemoAdapter("demo-all-r8", 8, ATTENTION + MLP, alpha=16, strength=0.03),
    DemoAdapter("demo-mlp-r16", 16, MLP, alpha=16, strength=0.04),
    DemoAdapter("demo-o-r2", 2, ("o_proj",), alpha=4, strength=0.2),
)


def write_adapter(spec: ModelSpec, adapter: DemoAdapter, out_dir: Path, base_model: str) -> Path:
    """One adapter folder, as PEFT's save_pretrained writes it."""
    generator = torch.Generator().manual_seed(zlib.crc32(adapter.name.encode()))
    tensors = {}
    for layer in range(spec.num_layers):
        for module in adapter.targets:
            in_features, out_features = spec.module_shape(module)
            prefix = f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}"
            a = torch.randn(adapter.rank, in_features, generator=generator) / math.sqrt(in_features)
            b = (
                torch.randn(out_features, adapter.rank, generator=generator)
                * adapter.strength
                / math.sqrt(adapter.rank)
            )
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    path = out_dir / adapter.name
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / WEIGHTS_FILE))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "lora_dropout": 0.0,
        "target_modules": list(adapter.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return path


def write_demo_adapters(model: str, out_dir: Path, force: bool = False) -> list[Path]:
    model_path = resolve_model_path(model)
    spec = ModelSpec.from_dir(model_path)
    paths = []
    for adapter in DEMO_ADAPTERS:
        path = out_dir / adapter.name
        if not force and (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file():
            logger.info("%s: present, kept", path)
        else:
            write_adapter(spec, adapter, out_dir, str(model_path))
            logger.info("%s: rank %d on %s", path, adapter.rank, ", ".join(adapter.targets))
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slora.backend.adapters.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="base model folder, or 'default'")
    parser.add_argument("--out", required=True, help="adapter root to write into")
    parser.add_argument("--force", action="store_true", help="rewrite adapters that are present")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    write_demo_adapters(args.model, Path(args.out), args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
