"""Build a tensor-parallel engine's parts: rank 0's Components (with its workers), and any rank's shard.

Checks that need the model (the partition, the page geometry) run before any worker starts, so that a bad
tensor_parallel_size fails at once with the field's name.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from slora.backend.adapters.host_adapter import HostAdapter
from slora.backend.adapters.store import AdapterStore
from slora.backend.config import EngineConfig, MiB
from slora.backend.engine.startup import Components, _eos_ids, _max_model_len, _num_pages, with_page_size
from slora.backend.memory.page_pool import PoolGeometry
from slora.backend.model.default_model import resolve_model_path
from slora.backend.model.spec import LORA_MODULES, ModelSpec
from slora.backend.model.tokenizer import load_tokenizer
from slora.backend.parallel.adapter_shard import load_adapter_shard
from slora.backend.parallel.collectives import Collectives
from slora.backend.parallel.decoder import ShardedDecoder
from slora.backend.parallel.layout import ShardPlan, rank_device
from slora.backend.parallel.pool_mirror import MirroredPagePool, RecordingAdapterCache
from slora.backend.parallel.weights import load_shard, random_shard
from slora.backend.parallel.workers import WorkerGroup
from slora.kernels.ops import make_ops
from slora.kernels.settings import warn_retired_environment

logger = logging.getLogger(__name__)


def build_sharded_components(config: EngineConfig) -> Components:
    """Rank 0's parts: its shard, pool, tokenizer, adapter store and cache, and the started workers."""
    base = config.torch_device()
    device, dtype = rank_device(base, 0), config.torch_dtype(base)
    model_path = resolve_model_path(config.model)
    spec = ModelSpec.from_dir(model_path)
    plan = ShardPlan(spec, config.tensor_parallel_size, 0)  # refuses a size the model cannot be split into
    geometry = shard_geometry(config, plan)
    config = with_page_size(config, geometry, shard_widest_row(plan))
    warn_retired_environment()
    logger.info("tensor parallelism: %d ranks (%s), %d q heads and %d KV heads per rank", plan.size,
                "NCCL" if device.type == "cuda" else "gloo", plan.heads, plan.kv_heads)  # fmt: skip
    workers = WorkerGroup.start(config, device)
    try:
        model, pool = build_shard(config, model_path, plan, device, dtype, workers.comm, record=True)
        workers.attach(pool)
        model.workers = workers
        workers.wait_ready()
    except RuntimeError as exc:  # a collective that failed: a worker died; say which
        workers.close()
        raise workers.error_for(exc) from exc
    except BaseException:
        workers.close()
        raise
    tokenizer = load_tokenizer(config.tokenizer or model_path)
    return Components(
        config=config,
        device=device,
        dtype=dtype,
        model_path=model_path,
        spec=spec,
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=_eos_ids(model_path, spec, tokenizer),
        max_model_len=_max_model_len(config, spec),
        pool=pool,
        store=_adapter_store(config, plan, geometry, dtype, device),
        cache=RecordingAdapterCache(pool),
        graphs=None,
        parallel=workers,
    )


def shard_geometry(config: EngineConfig, plan: ShardPlan) -> PoolGeometry:
    """A rank's page: its KV heads' share of one device's; checked to hold the rank's widest adapter row (a
    column-parallel lora_A row keeps the full hidden width: adapter_shard.py)."""
    local = plan.local_spec()
    return PoolGeometry.holding(plan.spec.num_layers, config.page_size, local.num_kv_heads, plan.spec.head_dim,
                                shard_widest_row(plan))  # fmt: skip


def shard_widest_row(plan: ShardPlan) -> int:
    spec, local = plan.spec, plan.local_spec()
    return max(spec.hidden_size, local.q_size, local.intermediate_size)


def build_shard(
    config: EngineConfig,
    model_path: Path,
    plan: ShardPlan,
    device: torch.device,
    dtype: torch.dtype,
    comm: Collectives,
    record: bool,
) -> tuple[ShardedDecoder, MirroredPagePool]:
    """Any rank's decoder over its shard and its pool; every rank calls this at once (the page count is agreed
    through the group: the smallest any rank can hold). `record`: rank 0's pool, whose changes are sent."""
    if config.load_format == "dummy":
        weights = random_shard(plan, dtype, device, config.seed)
    else:
        weights = load_shard(model_path, plan, dtype, device)
    settings = config.kernel_settings()
    ops = make_ops(config.kernel_backend, device, settings)
    model = ShardedDecoder(plan, weights, ops, _max_model_len(config, plan.spec), comm, settings)
    geometry = shard_geometry(config, plan)
    num_pages = comm.min_int(_num_pages(config, geometry, dtype, device))
    pool = MirroredPagePool(geometry, num_pages, dtype, device, record)
    if plan.rank == 0:
        logger.info("page pool of each rank: %d pages of %d tokens (%.1f MiB each across layers)", num_pages,
                    geometry.block_size, geometry.page_bytes(dtype) / MiB)  # fmt: skip
    return model, pool


def _adapter_store(
    config: EngineConfig, plan: ShardPlan, geometry: PoolGeometry, dtype: torch.dtype, device: torch.device
) -> AdapterStore:
    """Rank 0's store: each adapter read (and checked) as rank 0's shard; the others read theirs when it is made
    resident (follower.py)."""
    pin = device.type == "cuda" and config.pin_host_adapters

    def load(name: str, path: Path, generation: int) -> HostAdapter:
        adapter = load_adapter_shard(name, path, plan, geometry, dtype, pin, config.max_lora_rank, generation)
        ranks = {m: r for m, r in zip(LORA_MODULES, adapter.ranks) if r}
        logger.info("loaded adapter %r into host memory: ranks %s, %d pages per rank", name, ranks, adapter.num_pages)
        return adapter

    return AdapterStore(load, config.host_budget_bytes, config.adapter_root, config.adapter_registry)
