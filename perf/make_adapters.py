"""Generate n PEFT LoRA adapter directories for a model shape, fast, in S-LoRA's settings.

    python -m perf.make_adapters --model /tmp/slora-perf/model --setting S1 -n 2000 --out /tmp/slora-perf/adapters

Settings (S-LoRA's Table 2 for Llama-7B, plus one that targets every projection):
    S1    rank 8 on q, k, v, o
    S2    ranks 64, 32, 16, 8 on q, k, v, o (adapter i has rank RANKS[i % 4], as S-LoRA's benchmark assigns them)
    Sall  ranks 64, 32, 16, 8 on all seven projections (q, k, v, o, gate, up, down)

Disk: an S1 adapter of Llama-2-7B is 32 layers x 4 x 8 x (4096 + 4096) x 2 bytes = 16 MiB, so 2000 of them would
be 32 GiB. Only `distinct` weight files per rank are written (random A and B, small, nonzero) under
<out>/.weights/, and every adapter directory gets a hard link to one of them (a symlink where hard links are not
possible), next to its own adapter_config.json. Each adapter is still its own directory and name: the engine's
host store reads and keeps each one separately, and the page pool holds each one in its own pages, so the host
LRU, the pool and the kernels see n distinct adapters. What is not exercised is reading n distinct files from
disk (after the first read they come from the page cache): the values differ only across `distinct` files, which
does not change the work of any kernel.

Any shape of perf/make_model.py works: projection widths (GQA k/v, Qwen2's) come from the model's config.json.

Adapter names are <prefix><i:04d> (prefix "s1-", "s2-", "sall-" by default), the names traces refer to.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

logger = logging.getLogger(__name__)

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_MODULES = (*ATTENTION, "gate_proj", "up_proj", "down_proj")
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
POOL_DIR = ".weights"  # not a valid adapter name (leading dot), so the engine never lists it


@dataclass(frozen=True)
class AdapterSetting:
    name: str
    ranks: tuple[int, ...]  # adapter i gets ranks[i % len(ranks)]
    targets: tuple[str, ...]
    prefix: str

    def __post_init__(self) -> None:
        if not self.ranks or any(r < 1 for r in self.ranks):
            raise ValueError(f"ranks must be positive, got {self.ranks}")
        unknown = set(self.targets) - set(ALL_MODULES)
        if not self.targets or unknown:
            raise ValueError(f"targets must be among {ALL_MODULES}, got {self.targets}")

    def rank_of(self, index: int) -> int:
        return self.ranks[index % len(self.ranks)]

    def adapter_name(self, index: int) -> str:
        return f"{self.prefix}{index:04d}"


SETTINGS = {
    "S1": AdapterSetting("S1", (8,), ATTENTION, "s1-"),
    "S2": AdapterSetting("S2", (64, 32, 16, 8), ATTENTION, "s2-"),
    "Sall": AdapterSetting("Sall", (64, 32, 16, 8), ALL_MODULES, "sall-"),
}


@dataclass(frozen=True)
class ModelDims:
    """The projection shapes an adapter must match, read from the model's config.json."""

    num_layers: int
    hidden: int
    intermediate: int
    q_size: int
    kv_size: int

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelDims:
        config = json.loads((model_dir / "config.json").read_text())
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
        kv_heads = int(config.get("num_key_value_heads") or heads)
        return cls(
            num_layers=int(config["num_hidden_layers"]),
            hidden=int(config["hidden_size"]),
            intermediate=int(config["intermediate_size"]),
            q_size=heads * head_dim,
            kv_size=kv_heads * head_dim,
        )

    def shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features)."""
        h, i, q, kv = self.hidden, self.intermediate, self.q_size, self.kv_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[module]  # fmt: skip


def random_lora_tensors(
    dims: ModelDims, rank: int, targets: tuple[str, ...], seed: int, dtype: torch.dtype = torch.float16
) -> dict[str, torch.Tensor]:
    """PEFT-named lora_A [r, in] and lora_B [out, r], both random and nonzero, small enough to keep fp16 sane."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(dims.num_layers):
        for module in targets:
            parent = "self_attn" if module in ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            in_features, out_features = dims.shape(module)
            a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            b = torch.randn(out_features, rank, generator=generator) * (0.02 / rank**0.5)
            tensors[f"{prefix}.lora_A.weight"] = a.to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = b.to(dtype)
    return tensors


def adapter_config(rank: int, targets: tuple[str, ...], base_model: str) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def write_weight_pool(
    dims: ModelDims, setting: AdapterSetting, distinct: int, out: Path, seed: int
) -> dict[int, list[Path]]:
    """The distinct weight files of each rank: rank -> [file, ...]."""
    pool_dir = out / POOL_DIR
    pool_dir.mkdir(parents=True, exist_ok=True)
    files: dict[int, list[Path]] = {}
    for rank in sorted(set(setting.ranks)):
        files[rank] = []
        for k in range(distinct):
            path = pool_dir / f"{setting.name}-r{rank}-{k}.safetensors"
            tensors = random_lora_tensors(dims, rank, setting.targets, seed=seed * 1_000_003 + rank * 1009 + k)
            save_file(tensors, str(path), metadata={"format": "pt"})
            files[rank].append(path)
    return files


def link(source: Path, target: Path) -> str:
    """Hard link `target` to `source` (symlink, else copy, where that fails); returns which one it made."""
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
        return "hardlink"
    except OSError:
        pass
    try:
        target.symlink_to(source.resolve())
        return "symlink"
    except OSError:
        shutil.copyfile(source, target)
        return "copy"


def make_adapters(
    model_dir: Path,
    setting: AdapterSetting,
    n: int,
    out: Path,
    distinct: int = 4,
    seed: int = 0,
    progress: bool | None = None,
) -> list[str]:
    """Write n adapter directories under `out`; returns their names. Existing ones of the same names are replaced.
    `progress`: a progress bar (None: on a terminal only)."""
    if n < 1 or distinct < 1:
        raise ValueError(f"n and distinct must be positive, got n={n}, distinct={distinct}")
    dims = ModelDims.from_dir(model_dir)
    files = write_weight_pool(dims, setting, min(distinct, n), out, seed)
    names, modes = [], set()
    bar_off = None if progress is None else not progress
    for i in tqdm(range(n), desc=f"{setting.name} adapters", unit="adapter", disable=bar_off, leave=False):
        rank = setting.rank_of(i)
        directory = out / setting.adapter_name(i)
        directory.mkdir(parents=True, exist_ok=True)
        config = adapter_config(rank, setting.targets, str(model_dir))
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
        choices = files[rank]
        modes.add(link(choices[(i // len(setting.ranks)) % len(choices)], directory / WEIGHTS_FILE))
        names.append(directory.name)
    manifest = {"setting": setting.name, "n": n, "ranks": setting.ranks, "targets": setting.targets,
                "distinct_files_per_rank": min(distinct, n), "link": sorted(modes),
                "model": str(model_dir)}  # fmt: skip
    (out / POOL_DIR / f"{setting.name}.json").write_text(json.dumps(manifest, indent=1) + "\n")
    logger.info("wrote %d %s adapters under %s (%s to %d distinct file(s) per rank)", n, setting.name, out,
                "/".join(sorted(modes)), min(distinct, n))  # fmt: skip
    return names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="model directory (config.json)")
    parser.add_argument("--setting", choices=sorted(SETTINGS), action="append", required=True,
                        help="repeat for several settings")  # fmt: skip
    parser.add_argument("-n", "--num-adapters", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True, help="adapter root (one directory per adapter)")
    parser.add_argument("--distinct", type=int, default=4, help="distinct weight files per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (default: on a terminal)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for name in args.setting:
        make_adapters(args.model, SETTINGS[name], args.num_adapters, args.out, args.distinct, args.seed,
                      progress=False if args.no_progress else None)  # fmt: skip


if __name__ == "__main__":
    main()
