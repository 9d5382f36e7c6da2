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

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open

from slora.backend.errors import AdapterError
from slora.backend.memory.page_pool import PoolGeometry
from slora.backend.model.spec import LORA_MODULES, ModelSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
MAX_RANK = 256
MAX_CONFIG_RANK = 1 << 16  # `r` / rank_pattern values beyond this are no rank a LoRA file can hold
# The folded scale (alpha / r, or alpha / sqrt(r)) of every targeted layer must lie in this range. Trained
# adapters sit around 0.01-100; beyond 1e4 the LoRA term swamps the base model (and float16 activations overflow),
# below 1e-6 it is no adapter at all, and a scale that underflows to 0 cannot be folded (the ratios divide by it).
SCALE_RANGE = (1e-6, 1e4)

_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


@dataclass(frozen=True)
class AdapterRef:
    """What a queued request holds of its adapter: which one it is and how large, not its weights (so a long queue
    pins no host memory). Known from the adapter's config and safetensors header (describe.py), or from a
    HostAdapter; the scheduler gets the weights from the store when it admits the request (or reads ahead)."""

    name: str
    path: Path
    generation: int
    ranks: tuple[int, ...]  # per module of LORA_MODULES; 0 = not targeted
    num_pages: int  # pool pages it takes when resident
    nbytes: int  # bytes of its image in host memory

    @property
    def key(self) -> tuple[str, int]:
        return (self.name, self.generation)

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(m for m, r in zip(LORA_MODULES, self.ranks) if r)


@dataclass
class HostAdapter:
    """One adapter in host memory. Immutable once built; shared by every request that uses it."""

    name: str
    path: Path
    ranks: tuple[int, ...]  # per module of LORA_MODULES; 0 = not targeted
    scales: tuple[float, ...]  # per module
    image: torch.Tensor  # [num_layers, num_pages, page_elems], model dtype (page-locked with pin_host_adapters)
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

    @property
    def ref(self) -> AdapterRef:
        """What a queued request keeps of this adapter: its identity and size, not its weights."""
        return AdapterRef(self.name, self.path, self.generation, self.ranks, self.num_pages, self.nbytes)

    def without_image(self) -> HostAdapter:
        """This adapter with its image replaced by a meta tensor of the same shape and dtype: every field and
        property still answers, no host memory is held, and a copy out of it raises instead of copying garbage.
        What the pool keeps of an adapter once its copy is done (adapter_cache.py)."""
        return dataclasses.replace(self, image=torch.empty(self.image.shape, dtype=self.image.dtype, device="meta"))


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
    groups = _layout(ranks, spec, geometry)
    num_pages = sum(g.num_pages for g in groups)
    image = torch.zeros((spec.num_layers, num_pages, geometry.page_elems), dtype=dtype)
    try:
        _fill_image(image, groups, tensors, per_module, scales)
    except AdapterError as exc:
        raise AdapterError(f"adapter {name!r}: {path / WEIGHTS_FILE}: {exc}") from exc
    a_local, b_local = _row_offsets(groups, ranks, geometry.page_elems)
    if pin_memory:
        image = image.pin_memory()
    return HostAdapter(
        name=name,
        path=path,
        ranks=ranks,
        scales=scales,
        image=image,
        a_local=a_local,
        b_local=b_local,
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
    try:
        _check_config_numbers(config)
    except ValueError as exc:
        raise refuse(str(exc)) from None


def _check_config_numbers(config: dict[str, Any]) -> None:
    """Every number PEFT reads from the config is finite and in range; raises ValueError naming the field.

    json.loads accepts NaN and Infinity, and a NaN alpha reached the kernels as a NaN scale: every logit NaN,
    every sampled token 0, and no error anywhere.
    """
    if config.get("r") is not None:
        _check_rank("r", config["r"])
    if config.get("lora_alpha") is not None:
        _check_alpha("lora_alpha", config["lora_alpha"])
    for key, value in _pattern(config, "rank_pattern").items():
        _check_rank(f"rank_pattern[{key!r}]", value)
    for key, value in _pattern(config, "alpha_pattern").items():
        _check_alpha(f"alpha_pattern[{key!r}]", value)
    dropout = config.get("lora_dropout")
    if dropout is not None and not (_is_number(dropout) and 0.0 <= dropout <= 1.0):
        raise ValueError(f"lora_dropout must be a number from 0 to 1, got {dropout!r}")
    if not isinstance(config.get("use_rslora", False), bool):
        raise ValueError(f"use_rslora must be true or false, got {config['use_rslora']!r}")
    layers = config.get("layers_to_transform")
    listed = layers if isinstance(layers, list) else [] if layers is None else [layers]
    if not all(_is_int(layer) and layer >= 0 for layer in listed):
        raise ValueError(f"layers_to_transform must be a layer index or a list of them, got {layers!r}")


def _pattern(config: dict[str, Any], field: str) -> dict[str, Any]:
    pattern = config.get(field) or {}
    if not isinstance(pattern, dict):
        raise ValueError(f"{field} must be a JSON object of module pattern → value, got {pattern!r}")
    return pattern


def _check_rank(field: str, value: object) -> None:
    # The tensors' shapes give the ranks the engine uses (checked against max_rank there); a config rank beyond
    # MAX_CONFIG_RANK, or not an integer, is a broken file whatever the tensors say.
    if not _is_int(value) or not 1 <= value <= MAX_CONFIG_RANK:
        raise ValueError(f"{field} must be an integer rank from 1 to {MAX_CONFIG_RANK}, got {value!r}")


def _check_alpha(field: str, value: object) -> None:
    if not _is_number(value) or value <= 0:
        raise ValueError(f"{field} must be a finite positive number, got {value!r}")


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_tensors(name: str, path: Path, spec: ModelSpec, max_rank: int) -> dict[str, torch.Tensor]:
    weights = weights_file(name, path)
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


def weights_file(name: str, path: Path) -> Path:
    """The adapter's safetensors file; raises AdapterError when it is missing (naming a pickle file found instead)."""
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        pickles = [p for p in PICKLE_FILES if (path / p).exists()]
        if pickles:
            raise AdapterError(
                f"adapter {name!r}: {path / pickles[0]} is a pickle file, which is never loaded; "
                f"save the adapter with safetensors ({WEIGHTS_FILE})"
            )
        raise AdapterError(f"adapter {name!r}: {weights} is missing")
    return weights


def _check_tensor(name: str, weights: Path, key: str, tensor: torch.Tensor, spec: ModelSpec, max_rank: int) -> None:
    floating = tensor.is_floating_point()
    check_tensor_shape(name, weights, key, tuple(tensor.shape), (floating, str(tensor.dtype)), spec, max_rank)


def check_tensor_shape(
    name: str,
    weights: Path,
    key: str,
    shape: tuple[int, ...],
    dtype: tuple[bool, str],
    spec: ModelSpec,
    max_rank: int,
) -> None:
    """Refuse a tensor that is no LoRA weight of the base model, from its name, shape and dtype (whether it is a
    floating-point one, its name): a full read's checks, made from a safetensors header alone too (adapter_ref.py)."""

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
    if len(shape) != 2 or not dtype[0]:
        raise refuse(f"must be a 2-D floating-point matrix, got {shape} {dtype[1]}")
    in_features, out_features = spec.module_shape(module)
    rank = shape[0] if side == "A" else shape[1]
    expected = (rank, in_features) if side == "A" else (out_features, rank)
    if shape != expected:
        raise refuse(f"has shape {shape}, but the base model's {module} needs {expected}")
    if not 1 <= rank <= max_rank:
        raise refuse(f"has rank {rank}; ranks 1 to {max_rank} are supported")


def _collect(
    name: str, path: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any], spec: ModelSpec
) -> dict[str, dict[int, tuple[int, float]]]:
    """module → layer → (rank, PEFT scale), after checking that every A has its B of the same rank."""
    return collect_shapes(name, path, {key: tuple(t.shape) for key, t in tensors.items()}, config)


def collect_shapes(
    name: str, path: Path, shapes: dict[str, tuple[int, ...]], config: dict[str, Any]
) -> dict[str, dict[int, tuple[int, float]]]:
    """module → layer → (rank, PEFT scale) from each LoRA tensor's shape (already checked by check_tensor_shape),
    after checking that every A has its B of the same rank."""
    pairs: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        match = _KEY.match(key)
        assert match is not None  # checked in check_tensor_shape
        pairs.setdefault((int(match[1]), match[3]), {})[match[4]] = shape
    per_module: dict[str, dict[int, tuple[int, float]]] = {m: {} for m in LORA_MODULES}
    weights = path / WEIGHTS_FILE
    for (layer, module), sides in sorted(pairs.items()):
        where = f"adapter {name!r}: {weights}: layer {layer} {module}"
        if set(sides) != {"A", "B"}:
            raise AdapterError(f"{where} has lora_{''.join(sides)} without its lora_{'B' if 'A' in sides else 'A'}")
        rank = sides["A"][0]
        if sides["B"][1] != rank:
            raise AdapterError(f"{where}: lora_A rank {rank} != lora_B rank {sides['B'][1]}")
        module_key = f"model.layers.{layer}.{_PARENT[module]}.{module}"
        per_module[module][layer] = (rank, _checked_scale(name, path, config, module_key, rank))
    return per_module


def _checked_scale(name: str, path: Path, config: dict[str, Any], module_key: str, rank: int) -> float:
    """The PEFT scale of one layer's module, refused (naming the field it came from) outside SCALE_RANGE."""
    field, alpha = _alpha_of(config, module_key)
    scale = _scale(config, alpha, rank)
    low, high = SCALE_RANGE
    if not (math.isfinite(scale) and low <= scale <= high):
        rule = "sqrt(r)" if config.get("use_rslora") else "r"
        raise AdapterError(
            f"adapter {name!r}: {path / CONFIG_FILE}: {field}={alpha!r} gives {module_key} (rank {rank}) the scale "
            f"{field} / {rule} = {scale!r}; scales from {low:g} to {high:g} are supported"
        )
    return scale


def peft_scale(config: dict[str, Any], module_key: str, rank: int) -> float:
    """lora_alpha / r (or / sqrt(r) with use_rslora), with PEFT's alpha_pattern lookup."""
    return _scale(config, _alpha_of(config, module_key)[1], rank)


def _alpha_of(config: dict[str, Any], module_key: str) -> tuple[str, float]:
    """(the config field the module's alpha comes from, the alpha), with PEFT's alpha_pattern lookup."""
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module_key):
            return f"alpha_pattern[{pattern!r}]", value
    return "lora_alpha", config.get("lora_alpha", 8)


def _scale(config: dict[str, Any], alpha: float, rank: int) -> float:
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _reference_scale(layers: dict[int, tuple[int, float]]) -> float:
    return layers[min(layers)][1] if layers else 0.0


@dataclass(frozen=True)
class _RowGroup:
    """Rows of one width, packed page after page: blocks of (module index, side 'A'/'B', rank) in order."""

    width: int
    per_page: int
    first_page: int
    blocks: tuple[tuple[int, str, int], ...]

    @property
    def num_rows(self) -> int:
        return sum(rank for _, _, rank in self.blocks)

    @property
    def num_pages(self) -> int:
        return -(-self.num_rows // self.per_page)

    def offsets(self, row: int, count: int, page_elems: int) -> torch.Tensor:
        """Local element offsets of rows row .. row+count-1 of this group."""
        index = torch.arange(row, row + count, dtype=torch.int64)
        return (self.first_page + index // self.per_page) * page_elems + (index % self.per_page) * self.width

    def pieces(self, row: int, count: int) -> list[tuple[int, int, int, int]]:
        """Rows row .. row+count-1 of this group page by page: (page, first row in it, first of the rows, rows)."""
        pieces, done = [], 0
        while done < count:
            page, start = divmod(row + done, self.per_page)
            rows = min(count - done, self.per_page - start)
            pieces.append((self.first_page + page, start, done, rows))
            done += rows
        return pieces


def _layout(ranks: tuple[int, ...], spec: ModelSpec, geometry: PoolGeometry) -> list[_RowGroup]:
    """Group rows by width (so none straddles a page): per module, its A rows then its Bᵀ rows."""
    blocks: dict[int, list[tuple[int, str, int]]] = {}
    for m, (module, rank) in enumerate(zip(LORA_MODULES, ranks)):
        if rank:
            in_features, out_features = spec.module_shape(module)
            blocks.setdefault(in_features, []).append((m, "A", rank))
            blocks.setdefault(out_features, []).append((m, "B", rank))
    groups, first_page = [], 0
    for width, group_blocks in sorted(blocks.items()):
        group = _RowGroup(width, geometry.rows_per_page(width), first_page, tuple(group_blocks))
        groups.append(group)
        first_page += group.num_pages
    return groups


def _row_offsets(groups: list[_RowGroup], ranks: tuple[int, ...], page_elems: int) -> tuple[torch.Tensor, torch.Tensor]:
    """a_local, b_local: offsets of every A row and Bᵀ row, modules in LORA_MODULES order."""
    found: dict[tuple[int, str], torch.Tensor] = {}
    for group in groups:
        row = 0
        for m, side, rank in group.blocks:
            found[(m, side)] = group.offsets(row, rank, page_elems)
            row += rank
    empty = torch.zeros(0, dtype=torch.int64)
    a_local = torch.cat([empty] + [found[(m, "A")] for m, r in enumerate(ranks) if r])
    b_local = torch.cat([empty] + [found[(m, "B")] for m, r in enumerate(ranks) if r])
    return a_local, b_local


def _fill_image(
    image: torch.Tensor,
    groups: list[_RowGroup],
    tensors: dict[str, torch.Tensor],
    per_module: dict[str, dict[int, tuple[int, float]]],
    scales: tuple[float, ...],
) -> None:
    """Write each block's rows for all layers at once ([layers, rank, width]) straight into its group's pages.

    A few large tensor operations per block, not several per layer and tensor: thousands of small operations per
    adapter cost far more than its bytes, and their Python overhead holds the GIL, so threads cannot hide it.
    """
    keys = {(int(match[1]), match[3], match[4]): k for k in tensors if (match := _KEY.match(k))}
    num_layers = image.shape[0]
    for group in groups:
        row = 0
        for m, side, rank in group.blocks:
            module = LORA_MODULES[m]
            block_keys = [keys[(layer, module, side)] for layer in per_module[module]]
            weights = {layer: tensors[key] for layer, key in zip(per_module[module], block_keys)}
            block = _stack_layers(weights, side, rank, num_layers)
            # Any NaN or infinite element makes the sum NaN or infinite, so a finite sum clears the whole block.
            # Otherwise (or a float64 block, whose sums may overflow) the exact check finds the tensor to name.
            if block.dtype == torch.float64 or not torch.isfinite(block.sum()):
                _check_finite(tensors, block_keys)
            if side == "B":
                block = _fold_layer_scales(block, per_module[module], scales[m], image.dtype, module)
            elif block.dtype != image.dtype and block.element_size() == 2:
                block = block.to(torch.float32)  # 16-bit to another 16-bit type: exact through float32, and faster
            for page, start, first, count in group.pieces(row, rank):
                rows = image[:, page, start * group.width : (start + count) * group.width]
                rows.unflatten(1, (count, group.width)).copy_(block[:, first : first + count])
            row += rank


def _stack_layers(weights: dict[int, torch.Tensor], side: str, rank: int, num_layers: int) -> torch.Tensor:
    """[layers, rank, width]: each layer's lora_A or lora_Bᵀ, zero rows past its rank and for layers it skips."""
    rows = {layer: weight if side == "A" else weight.t() for layer, weight in weights.items()}
    for layer, weight in rows.items():
        if weight.shape[0] < rank:
            rows[layer] = F.pad(weight, (0, 0, 0, rank - weight.shape[0]))
    some = next(iter(rows.values()))
    absent = some.new_zeros((rank, some.shape[1]))
    return torch.stack([rows.get(layer, absent) for layer in range(num_layers)])


def _fold_layer_scales(
    block: torch.Tensor, layers: dict[int, tuple[int, float]], scale: float, dtype: torch.dtype, module: str
) -> torch.Tensor:
    """Bᵀ rows in float32, each layer's scale relative to the module's `scale` folded in; refused if the folded
    rows do not fit `dtype` (scales that differ by orders of magnitude across layers, through alpha_pattern)."""
    block = block.to(torch.float32)
    ratios = [layers[layer][1] / scale if layer in layers else 1.0 for layer in range(block.shape[0])]
    if any(ratio != 1.0 for ratio in ratios):
        block = block * torch.tensor(ratios, dtype=torch.float32).view(-1, 1, 1)
        largest = float(block.abs().amax())
        if not largest <= torch.finfo(dtype).max:  # also NaN
            raise AdapterError(
                f"{module}'s lora_B scaled by its per-layer scales (alpha_pattern, up to {max(ratios):g} times the "
                f"first layer's) reaches {largest:g}, beyond {dtype}"
            )
    return block


def _check_finite(tensors: dict[str, torch.Tensor], keys: list[str]) -> None:
    for key in keys:
        # A float64 sum of 16- or 32-bit floats is NaN or infinite exactly when some element is (no overflow).
        if not torch.isfinite(tensors[key].sum(dtype=torch.float64)):
            raise AdapterError(f"tensor {key!r} holds NaN or infinite values")
