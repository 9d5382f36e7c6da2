"""The "auto" engine options: each resolution rule on fake devices and memory, CPU values as before, explicit
values kept, and the values logged at start."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from slora.backend.config import EngineConfig, GiB
from slora.backend.engine import defaults
from slora.backend.engine.defaults import (
    AUTO_MIN_HOST_BUDGET,
    CPU_HOST_BUDGET_BYTES,
    CPU_MAX_BATCH_TOKENS,
    CPU_MAX_NUM_SEQS,
    available_host_bytes,
    cuda_graphs_rule,
    host_budget_rule,
    image_cache_rule,
    max_batch_tokens_rule,
    max_bypass_rule,
    max_num_seqs_rule,
    preload_rule,
    resolve_before_model,
    resolve_with_pool,
    warmup_rule,
)
from slora.backend.engine.llm_engine import LLMEngine
from tests.model_fixtures import ModelWithAdapters

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
AUTO = EngineConfig()


def test_cpu_values_are_those_before_auto() -> None:
    assert (CPU_MAX_NUM_SEQS, CPU_MAX_BATCH_TOKENS, CPU_HOST_BUDGET_BYTES) == (256, 2048, 8 * GiB)
    early, _ = resolve_before_model(AUTO, CPU, 100 * GiB, 10 * GiB, Path("/cache"))
    late, _ = resolve_with_pool(early, CPU, "torch", 10_000)
    assert (late.max_num_seqs, late.max_batch_tokens, late.host_budget_bytes) == (256, 2048, 8 * GiB)
    assert (late.cuda_graphs, late.preload_adapters, late.warmup, late.adapter_image_cache) == (False,) * 3 + ("off",)
    assert late.max_bypass == 0


def test_explicit_values_are_kept_on_cuda() -> None:
    given = EngineConfig(max_num_seqs=7, max_batch_tokens=99, host_budget_bytes=123, cuda_graphs=False,
                         preload_adapters=False, warmup=False, adapter_image_cache="off", max_bypass=3,
                         mixed_cuda_graphs=False, mixed_cuda_graph_tokens=50)  # fmt: skip
    early, choices = resolve_before_model(given, CUDA, 100 * GiB, 0, Path("/cache"))
    late, more = resolve_with_pool(early, CUDA, "triton", 10**6)
    assert late == given and all(c.why == "given" for c in choices + more)


@pytest.mark.parametrize(
    ("available", "weights", "ranks", "expected"),
    [
        (100 * GiB, 16 * GiB, 1, 42 * GiB),  # half of what the weights leave
        (100 * GiB, 16 * GiB, 2, 21 * GiB),  # split among the tensor-parallel ranks
        (3 * GiB, 2 * GiB, 1, AUTO_MIN_HOST_BUDGET),  # never below the floor
        (1 * GiB, 4 * GiB, 1, AUTO_MIN_HOST_BUDGET),  # weights beyond what is available
    ],
)
def test_host_budget_from_available_memory(available: int, weights: int, ranks: int, expected: int) -> None:
    config = EngineConfig(tensor_parallel_size=ranks)
    assert host_budget_rule(config, CUDA, available, weights).value == expected
    assert host_budget_rule(config, CPU, available, weights).value == CPU_HOST_BUDGET_BYTES


def test_available_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   100000000 kB\n")
    assert available_host_bytes(str(meminfo)) == 100_000_000 * 1024
    assert available_host_bytes(str(tmp_path / "missing")) > 0  # falls back to free pages


@pytest.mark.parametrize(
    ("pool_tokens", "expected"),
    [
        (202_000, 384),  # Llama-2-7B's MHA KV on an H200: 394 rounded down to the graphs' step
        (800_000, 512),  # Llama-3-8B's GQA KV: capped
        (4_000, 32),  # a small pool: the floor
    ],
)
def test_max_num_seqs_from_the_pool(pool_tokens: int, expected: int) -> None:
    assert max_num_seqs_rule(AUTO, CUDA, pool_tokens).value == expected
    assert max_num_seqs_rule(AUTO, CPU, pool_tokens).value == CPU_MAX_NUM_SEQS


@pytest.mark.parametrize(
    ("seqs", "pool_tokens", "expected"),
    [
        (512, 10**6, 2048),  # 4 tokens a sequence
        (1024, 10**6, 4096),
        (384, 10**6, 2048),  # at least the minimum
        (256, 6_000, 1500),  # at most a quarter of the pool
        (512, 1_000, 512),  # never below a full batch of decodes
    ],
)
def test_max_batch_tokens_from_the_batch_and_the_pool(seqs: int, pool_tokens: int, expected: int) -> None:
    assert max_batch_tokens_rule(AUTO, CUDA, seqs, pool_tokens).value == expected
    assert max_batch_tokens_rule(AUTO, CPU, seqs, pool_tokens).value == CPU_MAX_BATCH_TOKENS


def test_cuda_graphs_with_the_triton_kernels_on_cuda_only() -> None:
    assert cuda_graphs_rule(AUTO, CUDA, "triton").value is True
    assert cuda_graphs_rule(AUTO, CUDA, "torch").value is False
    assert cuda_graphs_rule(AUTO, CPU, "torch").value is False
    assert cuda_graphs_rule(EngineConfig(tensor_parallel_size=2), CUDA, "triton").value is False
    assert cuda_graphs_rule(EngineConfig(cuda_graphs=False), CUDA, "triton").value is False


def test_bypass_on_cuda_strict_order_on_cpu() -> None:
    assert max_bypass_rule(AUTO, CUDA).value == defaults.AUTO_MAX_BYPASS
    assert max_bypass_rule(AUTO, CPU).value == 0
    assert max_bypass_rule(EngineConfig(max_bypass=2), CPU).value == 2


def test_preload_and_warmup_on_for_cuda() -> None:
    for rule in (preload_rule, warmup_rule):
        assert rule(AUTO, CUDA).value is True and rule(AUTO, CPU).value is False
    assert preload_rule(EngineConfig(preload_adapters=True), CPU).value is True
    assert warmup_rule(EngineConfig(warmup=False), CUDA).value is False


def test_image_cache_under_the_slora_cache_on_cuda() -> None:
    root = Path("/var/cache/slora")
    assert image_cache_rule(AUTO, CUDA, root).value == str(root / defaults.IMAGE_CACHE_FOLDER)
    assert image_cache_rule(AUTO, CPU, root).value == "off"
    assert image_cache_rule(EngineConfig(tensor_parallel_size=2), CUDA, root).value == "off"
    assert image_cache_rule(EngineConfig(adapter_image_cache="/fast/disk"), CPU, root).value == "/fast/disk"


def test_auto_is_a_value_of_the_options_and_bad_values_name_their_field() -> None:
    parsed = EngineConfig.from_dict({"max_num_seqs": "auto", "warmup": "auto", "host_budget_bytes": "none"})
    assert (parsed.max_num_seqs, parsed.warmup, parsed.host_budget_bytes) == (None, None, None)
    assert EngineConfig.from_dict({"max_num_seqs": "512"}).max_num_seqs == 512
    for field, value in (("max_num_seqs", 0), ("max_batch_tokens", -1), ("host_budget_bytes", 0),
                         ("adapter_read_ahead", -1), ("max_bypass", -2), ("adapter_image_cache", "")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: value})  # type: ignore[arg-type]


def test_an_engine_logs_every_value_at_start(llama: ModelWithAdapters, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="slora.backend.engine.defaults"):
        engine = LLMEngine(EngineConfig(model=str(llama.base), device="cpu", pool_bytes=1 << 20, max_batch_tokens=512))
    lines = {r.getMessage().split(" = ")[0].removeprefix("engine option "): r.getMessage() for r in caplog.records}
    names = ("host_budget_bytes", "preload_adapters", "warmup", "adapter_image_cache", "max_bypass", "cuda_graphs",
             "max_num_seqs", "max_batch_tokens", "admit_interval", "overlap_steps", "admit_when_copied")  # fmt: skip
    for name in names:
        assert name in lines, name
    assert lines["max_batch_tokens"] == "engine option max_batch_tokens = 512 (given)"
    assert "auto" in lines["max_num_seqs"]
    c = engine.config
    assert (c.max_num_seqs, c.max_batch_tokens, c.host_budget_bytes, c.cuda_graphs, c.warmup) == (
        256, 512, 8 * GiB, False, False)  # fmt: skip
