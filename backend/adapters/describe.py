"""An adapter's identity and size (AdapterRef) from its config and safetensors header, without reading the weights.

A queued request needs only which adapter it is and how many pool pages and host bytes that adapter takes; both
follow from its ranks, which the header's tensor shapes give. Reading the config and the header (a few KB) instead
of the weights lets the engine take in requests for thousands of adapters without holding their weights, and
refuses what a full read refuses (load_peft_adapter, with the same messages), except what only the values show
(NaN or infinite weights, per-layer scales folded beyond the dtype): a full read finds those when the scheduler
reads the adapter, and the request fails then.

Safetensors layout: 8 bytes (little-endian u64) N, then N bytes of JSON: tensor name → {"dtype", "shape",
"data_offsets": [begin, end] relative to the end of the header}, plus an optional "__metadata__".
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

from slora.backend.adapters.host_adapter import (
    MAX_RANK,
    AdapterRef,
    _layout,
    _read_config,
    check_tensor_shape,
    collect_shapes,
    weights_file,
)
from slora.backend.errors import AdapterError
from slora.backend.memory.page_pool import PoolGeometry
from slora.backend.model.spec import LORA_MODULES, ModelSpec

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on the header's length
TensorHeader = tuple[tuple[int, ...], str]  # (shape, safetensors dtype name such as "BF16")


def describe_peft_adapter(
    name: str,
    path: str | Path,
    spec: ModelSpec,
    geometry: PoolGeometry,
    dtype: torch.dtype,
    max_rank: int = MAX_RANK,
    generation: int = 0,
) -> AdapterRef:
    """The AdapterRef load_peft_adapter's adapter would have (same ranks, pages and bytes), checked as it checks,
    from the config and the header only; raises AdapterError naming the file and the reason."""
    path = Path(path)
    config = _read_config(name, path)
    weights = weights_file(name, path)
    header = read_header(name, weights)
    for key, (shape, kind) in header.items():
        check_tensor_shape(name, weights, key, shape, (is_floating(kind), kind), spec, max_rank)
    per_module = collect_shapes(name, path, {key: shape for key, (shape, _) in header.items()}, config)
    ranks = tuple(max((r for r, _ in per_module[m].values()), default=0) for m in LORA_MODULES)
    num_pages = sum(g.num_pages for g in _layout(ranks, spec, geometry))
    nbytes = spec.num_layers * num_pages * geometry.page_elems * torch.empty((), dtype=dtype).element_size()
    return AdapterRef(name, path, generation, ranks, num_pages, nbytes)


def read_header(name: str, weights: Path) -> dict[str, TensorHeader]:
    """Every tensor of a safetensors file: name → (shape, dtype name); raises AdapterError when the file is no
    safetensors file (a bad header, data beyond the end of the file) or holds no tensor."""

    def refuse(reason: str) -> AdapterError:
        return AdapterError(f"adapter {name!r}: {weights} cannot be read as safetensors ({reason})")

    try:
        with open(weights, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise refuse("shorter than its header length")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES:
                raise refuse(f"header of {length} bytes")
            raw = handle.read(length)
            size = handle.seek(0, 2)
    except OSError as exc:
        raise refuse(str(exc)) from exc
    if len(raw) < length:
        raise refuse("the file ends inside its header")
    try:
        entries = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise refuse(f"header is not JSON: {exc}") from exc
    if not isinstance(entries, dict):
        raise refuse("header is not a JSON object")
    tensors = {key: _entry(key, value, size - 8 - length, refuse) for key, value in entries.items()
               if key != "__metadata__"}  # fmt: skip
    if not tensors:
        raise AdapterError(f"adapter {name!r}: {weights} holds no tensors")
    return tensors


def is_floating(kind: str) -> bool:
    """Whether a safetensors dtype name is a floating-point type (F64 .. F8_E4M3, BF16)."""
    return kind.startswith("F") or kind == "BF16"


def _entry(key: str, value: Any, data_bytes: int, refuse: Any) -> TensorHeader:
    """One header entry as (shape, dtype); refused when malformed or when its data lies beyond the file's end."""
    if not isinstance(value, dict) or not isinstance(value.get("dtype"), str):
        raise refuse(f"tensor {key!r} has no dtype")
    shape, offsets = value.get("shape"), value.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise refuse(f"tensor {key!r} has no valid shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) for n in offsets)):
        raise refuse(f"tensor {key!r} has no valid data_offsets")
    if not 0 <= offsets[0] <= offsets[1] <= data_bytes:
        raise refuse(f"tensor {key!r} lies beyond the end of the file (truncated?)")
    return tuple(shape), value["dtype"]
