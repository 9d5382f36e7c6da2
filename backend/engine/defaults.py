"""The engine options left "auto" (None), resolved once at start from the device, the machine, the model and the pool.

One function per rule, with the constants it uses. An explicit value is always kept as given, and on a CPU device
every rule gives the value the option had before it could be "auto", so CPU engines run as they always did. Two
stages, because the pool's size is known only once the weights are on the device:

    resolve_before_model   host_budget_bytes, preload_adapters, warmup, adapter_image_cache,  (device, machine)
                           max_bypass
    resolve_with_pool      cuda_graphs, mixed_cuda_graphs, max_num_seqs, max_batch_tokens,     (ops, pool, model)
                           mixed_cuda_graph_tokens

`log_choices` logs one INFO line per option at start: its value and why (the rule, or "given").

The CUDA constants are first choices, to be tuned by the served GPU runs of issue 27 (perf/bench_serving.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from slora.backend.config import EngineConfig, GiB, admit_when_copied, effective_admit_interval, overlap_enabled

logger = logging.getLogger(__name__)

# What the options were before "auto": still their values on CPU.
CPU_MAX_NUM_SEQS = 256
CPU_MAX_BATCH_TOKENS = 2048
CPU_HOST_BUDGET_BYTES = 8 * GiB

# max_num_seqs on CUDA: the pool's tokens over the tokens a running request is planned to hold (S-LoRA's traces:
# prompts and outputs of up to 512 tokens each), in steps of the decode graphs' buckets, within AUTO_SEQS.
AUTO_TOKENS_PER_SEQ = 512
AUTO_SEQS = (32, 512)
AUTO_SEQS_STEP = 16
# max_batch_tokens on CUDA: room for a full batch of decodes and AUTO_BATCH_TOKENS_PER_SEQ - 1 times as many
# prompt tokens (so admission goes on while the batch is full), at least AUTO_MIN_BATCH_TOKENS, and at most a
# quarter of the pool's tokens (one step never takes the pages its running requests need to grow).
AUTO_MIN_BATCH_TOKENS = 2048
# mixed_cuda_graph_tokens: steps with prompts of up to this many tokens replay graphs; larger ones run eagerly, their
# GPU time hiding their launches (perf/RESULTS.md measures the split).
AUTO_MIXED_GRAPH_TOKENS = 1024
AUTO_BATCH_TOKENS_PER_SEQ = 4
# host_budget_bytes on CUDA: this share of the memory available at start, less what the checkpoint takes (the
# weights pass through host memory while they load), split among the tensor-parallel ranks, and at least
# AUTO_MIN_HOST_BUDGET. The rest stays for the page cache, which holds the adapters' images below host memory.
AUTO_HOST_FRACTION = 0.5
AUTO_MIN_HOST_BUDGET = 1 * GiB
IMAGE_CACHE_FOLDER = "adapter-images"  # under $SLORA_CACHE (default_model.cache_root)
# max_bypass on CUDA: admissions ahead of a request the pool has no room for, at most (about a step's admissions
# under S-LoRA's traces: it waits a step or two longer, not more).
AUTO_MAX_BYPASS = 8


@dataclass(frozen=True)
class Choice:
    """One option's value at start and why it has it."""

    name: str
    value: object
    why: str


def resolve_before_model(
    config: EngineConfig, device: torch.device, available_bytes: int, weights_bytes: int, cache_root: Path
) -> tuple[EngineConfig, list[Choice]]:
    """The config with the options the device and the machine decide resolved (see the rules below)."""
    choices = [
        host_budget_rule(config, device, available_bytes, weights_bytes),
        preload_rule(config, device),
        warmup_rule(config, device),
        image_cache_rule(config, device, cache_root),
        max_bypass_rule(config, device),
    ]
    return _apply(config, choices), choices


def resolve_with_pool(
    config: EngineConfig, device: torch.device, ops_name: str, pool_tokens: int
) -> tuple[EngineConfig, list[Choice]]:
    """The config with the options the kernels and the pool decide resolved; `pool_tokens`: pages × page_size."""
    graphs = cuda_graphs_rule(config, device, ops_name)
    mixed = mixed_graphs_rule(config, cast(bool, graphs.value))
    seqs = max_num_seqs_rule(config, device, pool_tokens)
    tokens = max_batch_tokens_rule(config, device, cast(int, seqs.value), pool_tokens)
    choices = [graphs, mixed, seqs, tokens, mixed_graph_tokens_rule(config, cast(int, tokens.value))]
    return _apply(config, choices), choices


def host_budget_rule(config: EngineConfig, device: torch.device, available_bytes: int, weights_bytes: int) -> Choice:
    """CPU: CPU_HOST_BUDGET_BYTES. CUDA: AUTO_HOST_FRACTION of (available - weights), / tensor_parallel_size, at
    least AUTO_MIN_HOST_BUDGET."""
    name = "host_budget_bytes"
    if config.host_budget_bytes is not None:
        return Choice(name, config.host_budget_bytes, "given")
    if device.type != "cuda":
        return Choice(name, CPU_HOST_BUDGET_BYTES, "auto: the CPU default")
    room = max(0, available_bytes - weights_bytes)
    budget = max(AUTO_MIN_HOST_BUDGET, int(room * AUTO_HOST_FRACTION) // config.tensor_parallel_size)
    ranks = f" over {config.tensor_parallel_size} ranks" if config.tensor_parallel_size > 1 else ""
    why = (f"auto: {AUTO_HOST_FRACTION:g} of {_gib(available_bytes)} available less {_gib(weights_bytes)} of "
           f"weights{ranks}, at least {_gib(AUTO_MIN_HOST_BUDGET)}")  # fmt: skip
    return Choice(name, budget, why)


def preload_rule(config: EngineConfig, device: torch.device) -> Choice:
    """On for CUDA servers (the first requests of each adapter then find it in host memory), off on CPU."""
    return _on_for_cuda("preload_adapters", config.preload_adapters, device)


def warmup_rule(config: EngineConfig, device: torch.device) -> Choice:
    """On for CUDA (the kernels compile before the first request instead of during it), off on CPU."""
    return _on_for_cuda("warmup", config.warmup, device)


def image_cache_rule(config: EngineConfig, device: torch.device, cache_root: Path) -> Choice:
    """auto: `cache_root`/IMAGE_CACHE_FOLDER on CUDA without tensor parallelism (a rank's shard is laid out its own
    way), else off; "off" and a directory as given."""
    name, value = "adapter_image_cache", config.adapter_image_cache
    if value != "auto":
        return Choice(name, value, "given")
    if device.type != "cuda" or config.tensor_parallel_size > 1:
        why = "tensor parallelism" if device.type == "cuda" else "CPU"
        return Choice(name, "off", f"auto: off ({why})")
    return Choice(name, str(cache_root / IMAGE_CACHE_FOLDER), "auto: on CUDA, under the slora cache")


def max_bypass_rule(config: EngineConfig, device: torch.device) -> Choice:
    """CPU: 0 (strict order, as engines there always admitted). CUDA: AUTO_MAX_BYPASS."""
    if config.max_bypass is not None:
        return Choice("max_bypass", config.max_bypass, "given")
    if device.type != "cuda":
        return Choice("max_bypass", 0, "auto: strict order on CPU")
    return Choice("max_bypass", AUTO_MAX_BYPASS, "auto: bounded bypass on CUDA")


def cuda_graphs_rule(config: EngineConfig, device: torch.device, ops_name: str) -> Choice:
    """On when the model runs the Triton kernels on a CUDA device without tensor parallelism, else off."""
    if config.cuda_graphs is not None:
        return Choice("cuda_graphs", config.cuda_graphs, "given")
    on = device.type == "cuda" and ops_name == "triton" and config.tensor_parallel_size == 1
    why = "the Triton kernels on CUDA" if on else f"{ops_name} kernels on {device.type}"
    if on is False and config.tensor_parallel_size > 1:
        why = "tensor parallelism"
    return Choice("cuda_graphs", on, f"auto: {'on' if on else 'off'} ({why})")


def mixed_graphs_rule(config: EngineConfig, cuda_graphs: bool) -> Choice:
    """On with cuda_graphs (resolved), else off; a value given is kept, but on without cuda_graphs is refused."""
    name = "mixed_cuda_graphs"
    if config.mixed_cuda_graphs is not None:
        if config.mixed_cuda_graphs and not cuda_graphs:
            raise ValueError("mixed_cuda_graphs=true needs cuda_graphs, which is off here (a CUDA device and the "
                             "Triton kernels, without tensor parallelism)")  # fmt: skip
        return Choice(name, config.mixed_cuda_graphs, "given")
    return Choice(name, cuda_graphs, f"auto: {'on' if cuda_graphs else 'off'}, as cuda_graphs")


def mixed_graph_tokens_rule(config: EngineConfig, max_batch_tokens: int) -> Choice:
    """AUTO_MIXED_GRAPH_TOKENS, and never above max_batch_tokens (no step has more)."""
    name = "mixed_cuda_graph_tokens"
    given = config.mixed_cuda_graph_tokens
    if given is not None:
        return Choice(name, min(given, max_batch_tokens), "given" if given <= max_batch_tokens else
                      f"given, cut to max_batch_tokens ({max_batch_tokens})")  # fmt: skip
    return Choice(name, min(AUTO_MIXED_GRAPH_TOKENS, max_batch_tokens),
                  f"auto: {AUTO_MIXED_GRAPH_TOKENS}, at most max_batch_tokens")  # fmt: skip


def max_num_seqs_rule(config: EngineConfig, device: torch.device, pool_tokens: int) -> Choice:
    """CPU: CPU_MAX_NUM_SEQS. CUDA: pool_tokens / AUTO_TOKENS_PER_SEQ, rounded down to AUTO_SEQS_STEP, within
    AUTO_SEQS."""
    if config.max_num_seqs is not None:
        return Choice("max_num_seqs", config.max_num_seqs, "given")
    if device.type != "cuda":
        return Choice("max_num_seqs", CPU_MAX_NUM_SEQS, "auto: the CPU default")
    low, high = AUTO_SEQS
    seqs = min(high, max(low, pool_tokens // AUTO_TOKENS_PER_SEQ // AUTO_SEQS_STEP * AUTO_SEQS_STEP))
    why = f"auto: {pool_tokens} pool tokens / {AUTO_TOKENS_PER_SEQ} a request, within {low}..{high}"
    return Choice("max_num_seqs", seqs, why)


def max_batch_tokens_rule(config: EngineConfig, device: torch.device, max_num_seqs: int, pool_tokens: int) -> Choice:
    """CPU: CPU_MAX_BATCH_TOKENS. CUDA: AUTO_BATCH_TOKENS_PER_SEQ × max_num_seqs, at least AUTO_MIN_BATCH_TOKENS,
    at most a quarter of the pool's tokens, and never below max_num_seqs (a full batch's decodes fit one step)."""
    if config.max_batch_tokens is not None:
        return Choice("max_batch_tokens", config.max_batch_tokens, "given")
    if device.type != "cuda":
        return Choice("max_batch_tokens", CPU_MAX_BATCH_TOKENS, "auto: the CPU default")
    wanted = max(AUTO_MIN_BATCH_TOKENS, AUTO_BATCH_TOKENS_PER_SEQ * max_num_seqs)
    tokens = max(max_num_seqs, min(wanted, pool_tokens // 4))
    why = (f"auto: {AUTO_BATCH_TOKENS_PER_SEQ} × max_num_seqs, at least {AUTO_MIN_BATCH_TOKENS}, at most a "
           f"quarter of {pool_tokens} pool tokens")  # fmt: skip
    return Choice("max_batch_tokens", tokens, why)


def derived_choices(config: EngineConfig, device: torch.device) -> list[Choice]:
    """The options resolved where they are used (config.py's functions), for the start-up log."""
    interval = effective_admit_interval(config)
    return [
        Choice("admit_interval", interval, "given" if config.admit_interval else "auto: from cuda_graphs"),
        _on_for_cuda("overlap_steps", config.overlap_steps, device, overlap_enabled(config, device)),
        _on_for_cuda("admit_when_copied", config.admit_when_copied, device, admit_when_copied(config, device)),
    ]


def log_choices(choices: list[Choice]) -> None:
    """One INFO line per option: what the engine runs with, and why."""
    for choice in choices:
        logger.info("engine option %s = %s (%s)", choice.name, choice.value, choice.why)


def available_host_bytes(meminfo: str = "/proc/meminfo") -> int:
    """MemAvailable (memory the kernel can give without swapping, page cache included), else free pages."""
    try:
        with open(meminfo) as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def checkpoint_bytes(model_path: Path) -> int:
    """Bytes of the checkpoint's safetensors files (what loading the weights reads through host memory)."""
    return sum(f.stat().st_size for f in model_path.glob("*.safetensors"))


def _apply(config: EngineConfig, choices: list[Choice]) -> EngineConfig:
    return dataclasses.replace(config, **{c.name: c.value for c in choices})


def _on_for_cuda(name: str, given: bool | None, device: torch.device, value: bool | None = None) -> Choice:
    """`given` if set, else on for CUDA devices and off elsewhere (`value`: what config.py's rule gave)."""
    if given is not None:
        return Choice(name, given, "given")
    on = device.type == "cuda" if value is None else value
    return Choice(name, on, f"auto: {'on' if on else 'off'} on {device.type}")


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"
