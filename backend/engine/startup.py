"""Build the engine's parts from an EngineConfig: model, tokenizer, page pool, adapter store and cache."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from slora.backend.adapters.describe import describe_peft_adapter
from slora.backend.adapters.host_adapter import AdapterRef, HostAdapter, load_peft_adapter
from slora.backend.adapters.image_cache import ImageCache
from slora.backend.adapters.store import READER_THREADS, AdapterStore
from slora.backend.config import EngineConfig, MiB
from slora.backend.engine.defaults import (
    Choice,
    available_host_bytes,
    checkpoint_bytes,
    derived_choices,
    log_choices,
    resolve_before_model,
    resolve_with_pool,
)
from slora.backend.executor.cuda_graphs import DecodeGraphs, GraphLimits
from slora.backend.executor.mixed_graphs import MixedGraphs, MixedLimits
from slora.backend.memory.adapter_cache import AdapterCache
from slora.backend.memory.page_pool import DEFAULT_PAGE_SIZE, PageKind, PagePool, PoolGeometry
from slora.backend.model.checkpoint import load_checkpoint, random_weights
from slora.backend.model.decoder import DecoderModel
from slora.backend.model.default_model import cache_root, resolve_model_path
from slora.backend.model.spec import LORA_MODULES, ModelSpec
from slora.backend.model.tokenizer import load_tokenizer
from slora.backend.runtime.fresh_threads import FreshThreadExecutor
from slora.kernels.ops import KERNELS_EXTRA, Ops, make_ops
from slora.kernels.settings import KernelSettings, triton_interpreted, warn_retired_environment

if TYPE_CHECKING:
    from slora.backend.parallel.workers import WorkerGroup

logger = logging.getLogger(__name__)

CPU_DEFAULT_POOL_BYTES = 512 * MiB
CUDA_DEFAULT_POOL_FRACTION = 0.85


@dataclass
class Components:
    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    model_path: Path
    spec: ModelSpec
    model: DecoderModel
    tokenizer: Any | None
    eos_token_ids: frozenset[int]
    max_model_len: int
    pool: PagePool
    store: AdapterStore
    cache: AdapterCache
    graphs: DecodeGraphs | None
    mixed_graphs: MixedGraphs | None = None
    parallel: WorkerGroup | None = None  # the tensor-parallel workers (ranks 1 ..) when tensor_parallel_size > 1


def build_components(config: EngineConfig) -> Components:
    """The engine's parts, with the config's "auto" options resolved (defaults.py) and logged; `config` of the
    result is the resolved one."""
    device = config.torch_device()
    if config.kernel_backend == "triton" and device.type != "cuda" and not triton_interpreted():
        raise ValueError("kernel_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 to interpret on CPU)")
    if config.cuda_graphs and (device.type != "cuda" or config.kernel_backend not in ("auto", "triton")):
        raise ValueError("cuda_graphs needs a CUDA device and the triton kernel backend")
    model_path = resolve_model_path(config.model)
    weights = checkpoint_bytes(model_path) if config.load_format == "safetensors" else 0
    config, early = resolve_before_model(config, device, available_host_bytes(), weights, cache_root())
    if config.tensor_parallel_size > 1:  # rank 0 of a sharded model, workers started (backend/parallel/)
        from slora.backend.parallel.startup import build_sharded_components

        return _resolved(build_sharded_components(config), early)
    return _resolved(_build_one_device(config, device, model_path), early)


def _build_one_device(config: EngineConfig, device: torch.device, model_path: Path) -> Components:
    """Every part but the decode graphs (built once the batch limits are resolved, _resolved)."""
    dtype = config.torch_dtype(device)
    spec = ModelSpec.from_dir(model_path)
    max_model_len = _max_model_len(config, spec)
    logger.info("loading %s (%s, %d layers) on %s as %s", model_path, spec.architecture, spec.num_layers,
                device, dtype)  # fmt: skip
    if config.load_format == "dummy":
        weights = random_weights(spec, dtype, device, seed=config.seed)
    else:
        weights = load_checkpoint(model_path, spec, dtype, device)
    model = DecoderModel(spec, weights, _ops(config, device, config.kernel_settings()), max_model_len)
    widest = max(spec.hidden_size, spec.intermediate_size, spec.q_size)
    geometry = PoolGeometry.holding(spec.num_layers, config.page_size, spec.num_kv_heads, spec.head_dim, widest)
    config = with_page_size(config, geometry, widest)
    num_pages = _num_pages(config, geometry, dtype, device)
    pool = PagePool(geometry, num_pages, dtype, device, adapter_region_pages(config, num_pages))
    logger.info("page pool: %d pages of %d tokens (%.1f MiB each across layers)", pool.num_pages,
                geometry.block_size, geometry.page_bytes(dtype) / MiB)  # fmt: skip
    _log_regions(config, pool)
    tokenizer_path = config.tokenizer or model_path
    tokenizer = load_tokenizer(tokenizer_path)
    if tokenizer is None:
        logger.info("no tokenizer files in %s: prompts must be token ids", tokenizer_path)
    return Components(
        config=config,
        device=device,
        dtype=dtype,
        model_path=model_path,
        spec=spec,
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=_eos_ids(model_path, spec, tokenizer),
        max_model_len=max_model_len,
        pool=pool,
        store=_adapter_store(config, spec, geometry, dtype, device),
        cache=AdapterCache(pool),
        graphs=None,
    )


def _resolved(parts: Components, early: list[Choice]) -> Components:
    """`parts` with the options the kernels and the pool decide resolved, every option's value logged, and the
    decode graphs captured for the resolved batch limits."""
    # The tokens KV can hold: with a reserved adapter region, only the pages outside it.
    pool_tokens = parts.pool.num_pages_for(PageKind.KV) * parts.pool.geometry.block_size
    config, late = resolve_with_pool(parts.config, parts.device, parts.model.ops.name, pool_tokens)
    log_choices(early + late + derived_choices(config, parts.device))
    parts.config = config
    if parts.graphs is None:
        parts.graphs = _decode_graphs(config, parts.model, parts.pool, parts.max_model_len, config.kernel_settings())
        parts.mixed_graphs = _mixed_graphs(config, parts.model, parts.pool, parts.max_model_len, parts.graphs)
    return parts


def with_page_size(config: EngineConfig, geometry: PoolGeometry, widest_row: int) -> EngineConfig:
    """`config` with page_size as the pool has it, logged when it was auto."""
    if config.page_size is None:
        logger.info("page_size: %d tokens (auto: from %d, doubled until a page holds the widest adapter row, %d "
                    "elements)", geometry.block_size, DEFAULT_PAGE_SIZE, widest_row)  # fmt: skip
    return dataclasses.replace(config, page_size=geometry.block_size)


def _ops(config: EngineConfig, device: torch.device, settings: KernelSettings) -> Ops:
    """The model's ops for config.kernel_backend, the Triton kernels tuned by `settings`."""
    warn_retired_environment()
    ops = make_ops(config.kernel_backend, device, settings)
    if config.cuda_graphs and ops.name != "triton":
        raise ValueError(f"cuda_graphs needs the Triton kernels, not {ops.name!r}: {KERNELS_EXTRA}")
    return ops


def _decode_graphs(
    config: EngineConfig, model: DecoderModel, pool: PagePool, max_model_len: int, settings: KernelSettings
) -> DecodeGraphs | None:
    """With config.cuda_graphs, every bucket's decode graph, captured (`settings`: the ops', which pick their kinds)."""
    if not config.cuda_graphs:
        return None
    limits = GraphLimits(config.max_num_seqs, max_model_len, config.max_lora_rank)
    graphs = DecodeGraphs(model, pool, limits, settings=settings)
    graphs.capture_all()
    return graphs


def _mixed_graphs(
    config: EngineConfig, model: DecoderModel, pool: PagePool, max_model_len: int, graphs: DecodeGraphs | None
) -> MixedGraphs | None:
    """With config.mixed_cuda_graphs, every bucket's graph of steps with prompts without LoRA, captured in the decode
    graphs' memory pool (the adapters' families follow once the host adapters are known)."""
    if not config.mixed_cuda_graphs or graphs is None:
        return None
    assert config.mixed_cuda_graph_tokens is not None and config.max_num_seqs is not None  # resolved (defaults.py)
    limits = MixedLimits(config.mixed_cuda_graph_tokens, config.max_num_seqs, max_model_len, config.max_lora_rank)
    mixed = MixedGraphs(model, pool, limits, row_align=graphs.row_align, settings=graphs.settings,
                        pool_handle=graphs.pool_handle(), logits=graphs.logits_buffer())  # fmt: skip
    mixed.capture_all()
    return mixed


def _max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    limit = spec.max_position_embeddings
    if spec.sliding_window and spec.sliding_window < limit:
        # Attention here is full-context; within the window that equals sliding-window attention.
        limit = spec.sliding_window
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context ({limit})")
    return config.max_model_len or limit


def _num_pages(config: EngineConfig, geometry: PoolGeometry, dtype: torch.dtype, device: torch.device) -> int:
    page_bytes = geometry.page_bytes(dtype)
    if config.pool_bytes is not None:
        budget = config.pool_bytes
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * (config.pool_fraction or CUDA_DEFAULT_POOL_FRACTION))
    elif config.pool_fraction is not None:
        budget = int(available_host_bytes() * config.pool_fraction)
    else:
        budget = CPU_DEFAULT_POOL_BYTES
    if budget < page_bytes:
        raise ValueError(f"the page pool ({budget} bytes) is smaller than one page ({page_bytes} bytes)")
    return budget // page_bytes


def adapter_region_pages(config: EngineConfig, num_pages: int) -> int | None:
    """Pages reserved for adapter weights (config.adapter_region_fraction of the pool, at least one page, leaving at
    least one for KV), or None for the unified pool."""
    fraction = config.adapter_region_fraction
    if fraction is None:
        return None
    if num_pages < 2:
        raise ValueError(f"adapter_region_fraction={fraction} needs a pool of 2 pages at least, it has {num_pages}")
    return min(max(round(num_pages * fraction), 1), num_pages - 1)


def _log_regions(config: EngineConfig, pool: PagePool) -> None:
    if pool.unified:
        logger.info("page pool: unified (KV blocks and adapter weights share every page)")
        return
    adapter, kv = pool.num_pages_for(PageKind.ADAPTER), pool.num_pages_for(PageKind.KV)
    logger.info("page pool: reserved regions (adapter_region_fraction=%s): pages [0, %d) adapter weights only, "
                "[%d, %d) KV only (%d tokens)", config.adapter_region_fraction, adapter, adapter, pool.num_pages,
                kv * pool.geometry.block_size)  # fmt: skip


def _eos_ids(model_path: Path, spec: ModelSpec, tokenizer: Any | None) -> frozenset[int]:
    ids = set(spec.eos_token_ids)
    generation_config = model_path / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        ids |= set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _adapter_store(
    config: EngineConfig, spec: ModelSpec, geometry: PoolGeometry, dtype: torch.dtype, device: torch.device
) -> AdapterStore:
    """The store: adapters described from their headers, read on fresh threads (fresh_threads.py says why), through
    the image cache when config.adapter_image_cache names one."""
    pin = device.type == "cuda" and config.pin_host_adapters

    def convert(name: str, path: Path, generation: int) -> HostAdapter:
        adapter = load_peft_adapter(name, path, spec, geometry, dtype, pin, config.max_lora_rank, generation)
        ranks = {m: r for m, r in zip(LORA_MODULES, adapter.ranks) if r}
        # DEBUG: with more adapters than the host budget holds, conversions go on all the time (counted in the stats)
        logger.debug("converted adapter %r: ranks %s, %d pages", name, ranks, adapter.num_pages)
        return adapter

    def describe(name: str, path: Path, generation: int) -> AdapterRef:
        return describe_peft_adapter(name, path, spec, geometry, dtype, config.max_lora_rank, generation)

    cache = _image_cache(config, spec, geometry, dtype, pin)
    load = cache.wrap(convert) if cache is not None else convert
    readers = FreshThreadExecutor(max_workers=READER_THREADS, thread_name_prefix="slora-read")
    budget = config.host_budget_bytes
    assert budget is not None  # resolved (defaults.py)
    return AdapterStore(load, budget, config.adapter_root, config.adapter_registry, describe, readers)


def _image_cache(
    config: EngineConfig, spec: ModelSpec, geometry: PoolGeometry, dtype: torch.dtype, pin: bool
) -> ImageCache | None:
    """The image cache config.adapter_image_cache names (resolved: "off" or a directory), or None; a directory
    that cannot be made is logged and the engine runs without the cache."""
    if config.adapter_image_cache == "off":
        return None
    try:
        cache = ImageCache(config.adapter_image_cache, spec, geometry, dtype, config.max_lora_rank, pin)
    except OSError as exc:
        logger.warning("adapter_image_cache: %s cannot be used (%s); adapters are converted at every read",
                       config.adapter_image_cache, exc)  # fmt: skip
        return None
    logger.info("adapter image cache: %s", cache.directory)
    return cache
