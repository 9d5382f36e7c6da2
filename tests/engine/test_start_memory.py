"""A start that runs out of device memory raises StartupMemoryError naming the pool's size and the options that
leave more room, whether the pool was made yet or not, and for a pool sized by a fraction or by bytes."""

from __future__ import annotations

import pytest
import torch

from slora.backend.config import EngineConfig
from slora.backend.engine import llm_engine, startup
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.start_memory import StartupMemoryError
from tests.model_fixtures import ModelWithAdapters

TORCH_SAID = "CUDA out of memory. Tried to allocate 158.00 MiB"


def _config(model: ModelWithAdapters, **options: object) -> EngineConfig:
    return EngineConfig(model=str(model.base), adapter_root=str(model.adapter_root), device="cpu", dtype="float32",
                        page_size=8, max_num_seqs=12, warmup=True, **options)  # fmt: skip


def _out_of_memory(*_: object) -> None:
    raise torch.OutOfMemoryError(TORCH_SAID)


def test_running_out_in_the_warm_up_names_the_pool_and_the_options(
    llama: ModelWithAdapters, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llm_engine, "warm_up", _out_of_memory)
    with pytest.raises(StartupMemoryError) as raised:
        LLMEngine(_config(llama, pool_bytes=64 << 20))
    message = str(raised.value)
    assert "after the page pool took 0.1 GiB (pool_bytes=67108864)" in message
    assert "give a smaller pool_bytes, or fewer CUDA graph buckets (max_num_seqs, mixed_cuda_graph_tokens)" in message
    assert message.endswith(f"torch said: {TORCH_SAID}")
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)


def test_running_out_before_the_pool_suggests_a_smaller_fraction(
    llama: ModelWithAdapters, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llm_engine, "build_components", _out_of_memory)
    auto = r"while the engine started \(pool_fraction=0.85 \(auto\) of the memory free after the weights\): give a "
    with pytest.raises(StartupMemoryError, match=auto + r"smaller pool_fraction \(e.g. 0.75\) or pool_bytes"):
        LLMEngine(_config(llama))
    with pytest.raises(StartupMemoryError, match=r"\(pool_fraction=0.5 of the memory free after the weights\): give "
                       r"a smaller pool_fraction \(e.g. 0.4\)"):  # fmt: skip
        LLMEngine(_config(llama, pool_fraction=0.5))


def test_other_start_up_errors_pass_unchanged(llama: ModelWithAdapters, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: object) -> None:
        raise RuntimeError("something else")

    monkeypatch.setattr(startup, "load_tokenizer", broken)
    with pytest.raises(RuntimeError, match="^something else$"):
        LLMEngine(_config(llama, pool_bytes=8 << 20))
