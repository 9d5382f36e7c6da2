"""LoRA adapters read from PEFT directories into host memory, already laid out as pool pages.

A HostAdapter's `image` is [num_layers, num_pages, page_elems]: exactly what its pages will hold once resident,
so that making it resident is one copy per page slab, whichever physical pages it gets. Rows are grouped by
width (see page_pool's diagram); `a_local`/`b_local` give each rank row's offset as if the adapter's pages were
numbered 0..num_pages-1, and become pool offsets by replacing the page number with the physical page.

Scaling follows PEFT: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora, with alpha_pattern overrides.
Where one projection has different ranks in different layers (rank_pattern, layers_to_transform), rows are
zero-padded to the projection's largest rank in the layers that have fewer; where its scale differs across
layers, the difference is folded into that layer's B.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from slora.backend.errors import AdapterError
from slora.backend.model_spec import LORA_MODULES, ModelSpec
from slora.backend.page_pool import PoolGeometry

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
MAX_RANK = 256

_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


@dataclass
class HostAdapter:
    """One adapter in host memory. Immutable once built; shared by every request that uses it."""

    name: str
    path: Path
    ranks: tuple[int, ...]  # per module of LORA_MODULES; 0 = not targeted
    scales: tuple[float, ...]  # per module
    image: torch.Tensor  # [num_layers, num_pages, page_elems], model dtype, pinned where CUDA is present
    a_local: torch.Tensor  # int64 [sum(ranks)]: local offset of each lora_A row, modules in order
    b_local: torch.Tensor  # int64 [sum(ranks)]: local offset of each lora_Bᵀ row
    generation: int = 0  # bumped by the store when the name is registered again; (name, generation) is the key

    @property
    def key(self) -> tuple[str, int]:
        return (self.name, self.generation)

    @property
    def num_pages(self) -> int:
        return int(self.image.shape[1])

    @property
    def nbytes(self) -> int:
        return self.image.numel() * self.image.element_size()

    @property
    def max_rank(self) -> int:
        return max(self.ranks)

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(m for m, r in zip(LORA_MODULES, self.ranks) if r)


def load_peft_adapter(
    name: str,
    path: str | Path,
    spec: ModelSpec,
    geometry: PoolGeometry,
    dtype: torch.dtype,
    pin_memory: bool = False,
    max_rank: int = MAX_RANK,
    generation: int = 0,
) -> HostAdapter:
    """Read and check a PEFT LoRA directory; raise AdapterError naming the file and the reason."""
    path = Path(path)
    config = _read_config(name, path)
    tensors = _read_tensors(name, path, spec, max_rank)
    per_module = _collect(name, path, tensors, config, spec)
    ranks = tuple(max((r for r, _ in per_module[m].values()), default=0) for m in LORA_MODULES)
    scales = tuple(_reference_scale(per_module[m]) for m in LORA_MODULES)
    a_local, b_local, num_pages = _layout(ranks, spec, geometry)
    image = torch.zeros((spec.num_layers, num_pages, geometry.page_elems), dtype=dtype)
    _fill_image(image, tensors, per_module, ranks, scales, a_local, b_local, spec)
    if pin_memory:
        image = image.pin_memory()
    return HostAdapter(
        name=name,
        path=path,
        ranks=ranks,
        scales=scales,
        image=image,
        a_local=torch.cat(a_local) if a_local else torch.zeros(0, dtype=torch.int64),
        b_local=torch.cat(b_local) if b_local else torch.zeros(0, dtype=torch.int64),
        generation=generation,
    )


def _read_config(name: str, path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise AdapterError(f"adapter {name!r}: {path} is not a directory")
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise AdapterError(f"adapter {name!r}: {config_file} is missing")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"adapter {name!r}: {config_file} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {config_file} must hold a JSON object")
    _check_config(name, config_file, config)
    return config


def _check_config(name: str, config_file: Path, config: dict[str, Any]) -> None:
    def refuse(reason: str) -> AdapterError:
        return AdapterError(f"adapter {name!r}: {config_file}: {reason}")

    peft_type = str(config.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    if config.get("use_dora"):
        raise refuse("DoRA (use_dora=true) is not supported")
    if config.get("modules_to_save"):
        raise refuse(f"modules_to_save {config['modules_to_save']!r} is not supported (full weights, not LoRA)")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise refuse(f"bias={config.get('bias')!r} is not supported (only 'none')")
    for key in ("lora_alpha", "r"):
        value = config.get(key)
        if value is not None and (not isinstance(value, (int, float)) or value <= 0):
            raise refuse(f"{key} must be a positive number, got {value!r}")


def _read_tensors(name: str, path: Path, spec: ModelSpec, max_rank: int) -> dict[str, torch.Tensor]:
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        pickles = [p for p in PICKLE_FILES if (path / p).exists()]
        if pickles:
            raise AdapterError(
                f"adapter {name!r}: {path / pickles[0]} is a pickle file, which is never loaded; "
                f"save the adapter with safetensors ({WEIGHTS_FILE})"
            )
        raise AdapterError(f"adapter {name!r}: {weights} is missing")
    try:
        with safe_open(str(weights), framework="pt") as handle:
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"adapter {name!r}: {weights} cannot be read as safetensors ({exc})") from exc
    if not tensors:
        raise AdapterError(f"adapter {name!r}: {weights} holds no tensors")
    for key, tensor in tensors.items():
        _check_tensor(name, weights, key, tensor, spec, max_rank)
    return tensors


def _check_tensor(name: str, weights: Path, key: str, tensor: torch.Tensor, spec: ModelSpec, max_rank: int) -> None:
    def refuse(reason: str) -> AdapterError:
        return AdapterError(f"adapter {name!r}: {weights}: tensor {key!r} {reason}")

    match = _KEY.match(key)
    if not match:
        raise refuse("is not a LoRA weight of a q/k/v/o/gate/up/down projection (unknown target module)")
    layer, parent, module, side = int(match[1]), match[2], match[3], match[4]
    if module not in _PARENT or _PARENT[module] != parent:
        raise refuse(f"targets unknown module {parent}.{module}")
    if layer >= spec.num_layers:
        raise refuse(f"targets layer {layer}, but the base model has {spec.num_layers} layers")
    if tensor.dim() != 2 or not tensor.is_floating_point():
        raise refuse(f"must be a 2-D floating-point matrix, got {tuple(tensor.shape)} {tensor.dtype}")
    in_features, out_features = spec.module_shape(module)
    rank = tensor.shape[0] if side == "A" else tensor.shape[1]
    expected = (rank, in_features) if side == "A" else (out_features, rank)
    if tuple(tensor.shape) != expected:
        raise refuse(f"has shape {tuple(tensor.shape)}, but the base model's {module} needs {expected}")
    if not 1 <= rank <= max_rank:
        raise refuse(f"has rank {rank}; ranks 1 to {max_rank} are supported")
    if not torch.isfinite(tensor).all():
        raise refuse("holds NaN or infinite values")


def _collect(
    name: str, path: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any], spec: ModelSpec
) -> dict[str, dict[int, tuple[int, float]]]:
    """module → layer → (rank, PEFT scale), after checking that every A has its B of the same rank."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        assert match is not None  # checked in _check_tensor
        pairs.setdefault((int(match[1]), match[3]), {})[match[4]] = tensor
    per_module: dict[str, dict[int, tuple[int, float]]] = {m: {} for m in LORA_MODULES}
    for (layer, module), sides in sorted(pairs.items()):
        where = f"adapter {name!r}: {path / WEIGHTS_FILE}: layer {layer} {module}"
        if set(sides) != {"A", "B"}:
            raise AdapterError(f"{where} has lora_{''.join(sides)} without its lora_{'B' if 'A' in sides else 'A'}")
        rank = sides["A"].shape[0]
        if sides["B"].shape[1] != rank:
            raise AdapterError(f"{where}: lora_A rank {rank} != lora_B rank {sides['B'].shape[1]}")
        module_key = f"model.layers.{layer}.{_PARENT[module]}.{module}"
        per_module[module][layer] = (rank, peft_scale(config, module_key, rank))
    return per_module


def peft_scale(config: dict[str, Any], module_key: str, rank: int) -> float:
    """lora_alpha / r (or / sqrt(r) with use_rslora), with PEFT's alpha_pattern lookup."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module_key):
            alpha = value
            break
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _reference_scale(layers: dict[int, tuple[int, float]]) -> float:
    return layers[min(layers)][1] if layers else 0.0


def _layout(
    ranks: tuple[int, ...], spec: ModelSpec, geometry: PoolGeometry
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Local offsets of every A row and Bᵀ row, grouped by row width so rows never straddle pages."""
    rows_by_width: dict[int, list[tuple[int, str, int]]] = {}
    for m, (module, rank) in enumerate(zip(LORA_MODULES, ranks)):
        in_features, out_features = spec.module_shape(module)
        for j in range(rank):
            rows_by_width.setdefault(in_features, []).append((m, "A", j))
            rows_by_width.setdefault(out_features, []).append((m, "B", j))
    offsets: dict[tuple[int, str, int], int] = {}
    first_page = 0
    for width, rows in sorted(rows_by_width.items()):
        per_page = geometry.rows_per_page(width)
        for i, row in enumerate(rows):
            offsets[row] = (first_page + i // per_page) * geometry.page_elems + (i % per_page) * width
        first_page += -(-len(rows) // per_page)
    a_local = [torch.tensor([offsets[(m, "A", j)] for j in range(r)], dtype=torch.int64)
               for m, r in enumerate(ranks) if r]  # fmt: skip
    b_local = [torch.tensor([offsets[(m, "B", j)] for j in range(r)], dtype=torch.int64)
               for m, r in enumerate(ranks) if r]  # fmt: skip
    return a_local, b_local, first_page


def _fill_image(
    image: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    per_module: dict[str, dict[int, tuple[int, float]]],
    ranks: tuple[int, ...],
    scales: tuple[float, ...],
    a_local: list[torch.Tensor],
    b_local: list[torch.Tensor],
    spec: ModelSpec,
) -> None:
    keys = {(int(match[1]), match[3], match[4]): k for k in tensors if (match := _KEY.match(k))}
    targeted = [i for i, r in enumerate(ranks) if r]
    for slot, m in enumerate(targeted):
        module = LORA_MODULES[m]
        in_features, out_features = spec.module_shape(module)
        for layer, (rank, scale) in per_module[module].items():
            a = tensors[keys[(layer, module, "A")]].to(torch.float32)  # [rank, in]
            b = tensors[keys[(layer, module, "B")]].to(torch.float32)  # [out, rank]
            if scale != scales[m]:
                b = b * (scale / scales[m])
            flat = image[layer].view(-1)
            a_rows = a_local[slot][:rank, None] + torch.arange(in_features)
            b_rows = b_local[slot][:rank, None] + torch.arange(out_features)
            flat[a_rows] = a.to(image.dtype)
            flat[b_rows] = b.t().to(image.dtype)
