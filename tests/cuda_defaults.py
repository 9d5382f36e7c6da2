"""`pytest -p tests.cuda_defaults`: engines whose device is "auto" take, on this CPU machine, every "auto" option
and the dtype they would take on a CUDA device (warm-up, preload, the image cache, max_bypass, overlapped steps,
admit-when-copied, bf16, max_num_seqs and max_batch_tokens from the pool, the admission interval of CUDA graphs),
while they still run on the CPU.

Tests written on a CPU machine see the CPU values of those options; on the GPU host the same tests see the CUDA
ones, and a test that assumed a CPU value fails there, where it costs device time to find. This rehearsal finds
them here (`make test` runs the engine-side suites under it). An engine given device="cpu" keeps the CPU values.
"""

from __future__ import annotations

from typing import Any

import torch

import slora.backend.config as config_module
import slora.backend.engine.llm_engine as llm_engine
import slora.backend.engine.startup as startup

CUDA = torch.device("cuda")
_resolve_before_model = startup.resolve_before_model
_resolve_with_pool = startup.resolve_with_pool
_torch_dtype = config_module.EngineConfig.torch_dtype


def _seen_device(config: config_module.EngineConfig, device: torch.device) -> torch.device:
    """The device the rules see: CUDA for an "auto" device that resolved to the CPU."""
    return CUDA if config.device == "auto" and device.type == "cpu" else device


def _before_model(config: config_module.EngineConfig, device: torch.device, *args: Any) -> Any:
    return _resolve_before_model(config, _seen_device(config, device), *args)


def _with_pool(config: config_module.EngineConfig, device: torch.device, *args: Any) -> Any:
    return _resolve_with_pool(config, _seen_device(config, device), *args)


def _overlap(config: config_module.EngineConfig, device: torch.device) -> bool:
    return config_module.overlap_enabled(config, _seen_device(config, device))


def _admit_when_copied(config: config_module.EngineConfig, device: torch.device) -> bool:
    return config_module.admit_when_copied(config, _seen_device(config, device))


def _admit_interval(config: config_module.EngineConfig) -> int:
    """As with CUDA graphs, which the Triton kernels have on CUDA (the torch kernels here have none)."""
    if config.admit_interval == 0 and config.device == "auto":
        return config_module.AUTO_ADMIT_INTERVAL
    return config_module.effective_admit_interval(config)


def _dtype(config: config_module.EngineConfig, device: torch.device) -> torch.dtype:
    return _torch_dtype(config, _seen_device(config, device))


def pytest_configure() -> None:
    startup.resolve_before_model = _before_model  # type: ignore[assignment]
    startup.resolve_with_pool = _with_pool  # type: ignore[assignment]
    llm_engine.overlap_enabled = _overlap  # type: ignore[assignment]
    llm_engine.admit_when_copied = _admit_when_copied  # type: ignore[assignment]
    llm_engine.effective_admit_interval = _admit_interval  # type: ignore[assignment]
    config_module.EngineConfig.torch_dtype = _dtype  # type: ignore[method-assign]
