"""The tensor-parallel partition without processes: which slices each rank holds, that the shards of an adapter add
up to the whole adapter, and that a size the model cannot be split into is refused naming the field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slora.backend.adapters.host_adapter import HostAdapter, load_peft_adapter
from slora.backend.config import EngineConfig
from slora.backend.launcher.cli import parse_options
from slora.backend.memory.page_pool import PoolGeometry
from slora.backend.model.spec import LORA_MODULES, ModelSpec
from slora.backend.parallel.adapter_shard import ShardedHostAdapter, load_adapter_shard, shard_rows
from slora.backend.parallel.layout import COLUMN_PARALLEL, ShardPlan, check_partition
from slora.backend.parallel.startup import shard_geometry
from slora.kernels.reference.lora import gather_rows
from tests.model_fixtures import ModelWithAdapters


def _spec(heads: int = 8, kv: int = 2, vocab: int = 160) -> ModelSpec:
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": heads,
              "num_key_value_heads": kv}  # fmt: skip
    return ModelSpec.from_config(config)


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_ranks_cover_every_head_column_and_token(size: int) -> None:
    spec = _spec(vocab=157)  # not divisible: the last shard is padded
    plans = [ShardPlan(spec, size, rank) for rank in range(size)]
    q = [plan.out_range("q_proj") for plan in plans]
    assert q[0][0] == 0 and q[-1][1] == spec.q_size and all(a[1] == b[0] for a, b in zip(q, q[1:]))
    inter = [plan.out_range("gate_proj") for plan in plans]
    assert inter[-1][1] == spec.intermediate_size and all(a[1] == b[0] for a, b in zip(inter, inter[1:]))
    assert all(p.vocab * size >= spec.vocab_size and p.first_token == p.rank * p.vocab for p in plans)
    for plan in plans:  # each rank's q heads read the KV heads it holds (GQA groups never straddle ranks)
        group = spec.num_heads // spec.num_kv_heads
        first_q = plan.rank * plan.heads
        assert [h // group for h in range(first_q, first_q + plan.heads)] == [
            plan.first_kv_head + i * plan.kv_heads // plan.heads for i in range(plan.heads)
        ]
    if size > spec.num_kv_heads:  # fewer KV heads than ranks: each head on size / kv ranks
        assert [p.first_kv_head for p in plans] == [r * spec.num_kv_heads // size for r in range(size)]
        assert all(p.kv_heads == 1 for p in plans)


@pytest.mark.parametrize(
    ("heads", "kv", "size", "field"),
    [(8, 2, 3, "num_attention_heads"), (12, 4, 8, "num_attention_heads"), (8, 8, 0, "positive integer")],
)
def test_a_size_the_model_cannot_split_is_refused(heads: int, kv: int, size: int, field: str) -> None:
    with pytest.raises(ValueError, match=f"tensor_parallel_size.*{field}"):
        check_partition(_spec(heads, kv), size)


def test_kv_heads_and_size_must_divide_one_another() -> None:
    spec = dataclasses.replace(_spec(8, 8), num_kv_heads=6)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_partition(spec, 4)


def test_engine_config_field_and_cli_flag() -> None:
    assert EngineConfig().tensor_parallel_size == 1
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            EngineConfig(tensor_parallel_size=bad)
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(tensor_parallel_size=2, cuda_graphs=True)
    with pytest.raises(ValueError, match="bmm"):
        EngineConfig(tensor_parallel_size=2, kernel_backend="bmm")
    assert EngineConfig.from_dict({"tensor_parallel_size": "4"}).tensor_parallel_size == 4
    assert parse_options(["--tensor-parallel-size", "2"]).engine["tensor_parallel_size"] == "2"


def _a(host: HostAdapter, layer: int, m: int, width: int) -> torch.Tensor:
    """[rows, width]: module m's lora_A rows in one layer, read from the adapter's own image (its pages 0 ..)."""
    counts = host.shrink_rows if isinstance(host, ShardedHostAdapter) else host.ranks
    return _module_rows(host.a_local, counts, m, host.image[layer], width)


def _bt(host: HostAdapter, layer: int, m: int, width: int) -> torch.Tensor:
    counts = host.expand_rows if isinstance(host, ShardedHostAdapter) else host.ranks
    return _module_rows(host.b_local, counts, m, host.image[layer], width)


def _module_rows(local: torch.Tensor, counts: tuple[int, ...], m: int, image: torch.Tensor, width: int) -> torch.Tensor:
    start = sum(counts[:m])
    return gather_rows(image.reshape(-1), local[start : start + counts[m]], width)


def _span(span: tuple[int, int]) -> int:
    return span[1] - span[0]


@pytest.mark.parametrize("size", [2, 4])
def test_adapter_shards_add_up_to_the_whole_adapter(llama: ModelWithAdapters, size: int) -> None:
    """For every adapter, layer and module, the ranks' rows give the one-device delta x·Aᵀ·B (S-LoRA's partition:
    column-parallel B by output columns and A by strided rank rows, x·Aᵀ all-gathered; row-parallel A by input
    columns, x·Aᵀ all-reduced, B by the hidden slice each rank adds to its partial sum)."""
    spec = ModelSpec.from_dir(llama.base)
    config = EngineConfig(page_size=8, tensor_parallel_size=size)
    whole_geometry = PoolGeometry(spec.num_layers, 8, spec.num_kv_heads, spec.head_dim)
    plans = [ShardPlan(spec, size, rank) for rank in range(size)]
    for name in llama.adapters:
        path = llama.adapter_root / name
        whole = load_peft_adapter(name, path, spec, whole_geometry, torch.float32)
        shards = [load_adapter_shard(name, path, p, shard_geometry(config, p), torch.float32) for p in plans]
        assert len({s.num_pages for s in shards}) == 1, "every rank's share takes the same pages"
        assert all(s.ranks == whole.ranks and s.scales == whole.scales for s in shards)
        for m, module in enumerate(LORA_MODULES):
            if whole.ranks[m]:
                assert (shards[0].shrink_rows[m], shards[0].expand_rows[m]) == shard_rows(module, whole.ranks[m], size)
                for layer in range(spec.num_layers):
                    _check_module(whole, shards, plans, layer, m)


def _check_module(
    whole: HostAdapter, shards: list[ShardedHostAdapter], plans: list[ShardPlan], layer: int, m: int
) -> None:
    module = LORA_MODULES[m]
    in_features, out_features = plans[0].spec.module_shape(module)
    x = torch.randn(3, in_features, generator=torch.Generator().manual_seed(layer * 7 + m))
    expected = x @ _a(whole, layer, m, in_features).t() @ _bt(whole, layer, m, out_features)  # [3, out]
    if module in COLUMN_PARALLEL:
        gathered = torch.stack([x @ _a(s, layer, m, in_features).t() for s in shards])  # [n, 3, ⌈r/n⌉]
        h = gathered.permute(1, 2, 0).reshape(3, -1)  # as ShardedLora.column puts the all-gather in order
        for plan, shard in zip(plans, shards):
            span = plan.out_range(module)
            got = h @ _bt(shard, layer, m, _span(span))
            torch.testing.assert_close(got, expected[:, span[0] : span[1]], rtol=1e-5, atol=1e-5)
        return
    partial = [x[:, slice(*p.in_range(module))] @ _a(s, layer, m, _span(p.in_range(module))).t()
               for p, s in zip(plans, shards)]  # fmt: skip
    h = torch.stack(partial).sum(0)  # the all-reduce
    total = torch.zeros_like(expected)
    for plan, shard in zip(plans, shards):
        total[:, slice(*plan.hidden_range())] += h @ _bt(shard, layer, m, plan.hidden)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)
