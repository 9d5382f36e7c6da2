"""Greedy tokens of every adapter, all served together in one batch, equal HF transformers + PEFT alone."""

from __future__ import annotations

import random

import pytest
import torch

from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.sampling_params import SamplingParams
from slora.kernels.metadata import LoraMeta, SegmentGroup
from slora.kernels.settings import triton_interpreted
from slora.kernels.triton import lora_call, projection
from tests.factories import hf_reference
from tests.model_fixtures import ModelWithAdapters
from tests.reference import compare_greedy, hf_greedy

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _jobs(model: ModelWithAdapters, prompts: list[list[int]]) -> list[tuple[list[int], str | None]]:
    """Every adapter and the base model, each on two prompts of different lengths."""
    names: list[str | None] = [None, *model.adapters]
    return [(prompts[(i + k) % len(prompts)], name) for i, name in enumerate(names) for k in range(2)]


def _check(model: ModelWithAdapters, config: EngineConfig, prompt_lengths: list[int]) -> LLMEngine:
    engine = LLMEngine(config)
    prompts = _prompts(engine.spec.vocab_size, prompt_lengths, seed=7)
    jobs = _jobs(model, prompts)
    results = engine.generate([p for p, _ in jobs], [a for _, a in jobs], GREEDY)
    compared = total = 0
    references: dict[str | None, object] = {}
    for (prompt, adapter), result in zip(jobs, results):
        if adapter not in references:
            references[adapter] = hf_reference(model.base, model.adapter_root / adapter if adapter else None)
        ref = hf_greedy(references[adapter], prompt, MAX_NEW)
        compared += compare_greedy(result.token_ids, ref, tie_margin=1e-4)
        total += MAX_NEW
    assert compared >= 0.9 * total, f"only {compared}/{total} tokens were outside near ties"
    engine.check_idle_integrity()
    return engine


def _config(model: ModelWithAdapters, target: dict[str, str], **options: object) -> EngineConfig:
    values = {"model": str(model.base), "adapter_root": str(model.adapter_root), "pool_bytes": 8 << 20}
    return EngineConfig(**{**values, **target, **options})  # type: ignore[arg-type]


def test_llama_gqa_all_adapters_one_batch(llama: ModelWithAdapters, target: dict[str, str]) -> None:
    _check(llama, _config(llama, target, page_size=4), prompt_lengths=[5, 17, 9, 30])


def test_llama_chunked_prefill_mixed_with_decode(llama: ModelWithAdapters, target: dict[str, str]) -> None:
    """A small token budget splits prompts into chunks that share steps with other requests' decodes."""
    _check(llama, _config(llama, target, page_size=8, max_batch_tokens=13), prompt_lengths=[29, 3, 41, 11])


@pytest.mark.parametrize("backend", ["triton", "bmm"])
def test_llama_other_kernel_backends_on_cpu(llama: ModelWithAdapters, backend: str) -> None:
    """The Triton kernels (interpreted on CPU) and the padded-BMM baseline serve the same mixed batch."""
    if backend == "triton" and not triton_interpreted():
        pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1 (set where CUDA is absent)")
    target = {"device": "cpu", "kernel_backend": backend, "dtype": "float32"}
    _check(llama, _config(llama, target, page_size=8, max_batch_tokens=24), prompt_lengths=[5, 17, 9])


def test_llama_split_lora_launches_on_cpu(llama: ModelWithAdapters, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's decodes and prompts in LoRA launches of their own (EngineConfig.lora_split) serve the same tokens;
    the batches do split (some step has both decodes and a prompt segment longer than SHORT_SEGMENT)."""
    split_groups: list[int] = []
    groups = LoraMeta.groups

    def counting(self: LoraMeta, split: bool) -> list[SegmentGroup]:
        result = groups(self, split)
        split_groups.append(len(result))
        return result

    monkeypatch.setattr(LoraMeta, "groups", counting)
    target = {"device": "cpu", "kernel_backend": "triton", "dtype": "float32"}
    _check(
        llama, _config(llama, target, page_size=8, max_batch_tokens=48, lora_split=True), prompt_lengths=[5, 30, 9, 21]
    )
    assert 2 in split_groups, split_groups


def test_llama_fused_lora_on_cpu(llama: ModelWithAdapters, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes on the fused LoRA kernel (EngineConfig.lora_fused) serve the same tokens; the engine does launch it."""
    launched: list[int] = []
    fused_launch = lora_call.fused_launch
    monkeypatch.setattr(lora_call, "fused_launch", lambda *a, **kw: launched.append(a[4]) or fused_launch(*a, **kw))
    target = {"device": "cpu", "kernel_backend": "triton", "dtype": "float32"}
    _check(
        llama, _config(llama, target, page_size=8, max_batch_tokens=48, lora_fused=True), prompt_lengths=[5, 30, 9, 21]
    )
    assert launched, "no step launched the fused kernel"


def test_llama3_rope_scaling_tied_embeddings(llama3_scaled: ModelWithAdapters, target: dict[str, str]) -> None:
    # Prompts longer than original_max_position_embeddings (64) exercise the scaled frequencies.
    _check(llama3_scaled, _config(llama3_scaled, target, page_size=16), prompt_lengths=[70, 90, 7])


def test_qwen2_qkv_bias(qwen2: ModelWithAdapters, target: dict[str, str]) -> None:
    _check(qwen2, _config(qwen2, target, page_size=8), prompt_lengths=[6, 19, 12])


def test_auto_page_size_holds_the_widest_adapter_row(qwen2_wide_mlp: ModelWithAdapters, target: dict[str, str]) -> None:
    """page_size left auto on a model whose 16-token pages are narrower than its MLP adapter rows (Qwen2.5-7B's
    case): the engine starts with pages of 32 tokens, serves every adapter (MLP ones included) as HF + PEFT
    does, and says so in its config."""
    engine = _check(qwen2_wide_mlp, _config(qwen2_wide_mlp, target), prompt_lengths=[6, 40, 21])
    assert engine.pool.geometry.block_size == 32
    assert engine.config.page_size == 32


def test_mistral_sharded_checkpoint(mistral_sharded: ModelWithAdapters, target: dict[str, str]) -> None:
    assert len(list(mistral_sharded.base.glob("*.safetensors"))) > 1
    _check(mistral_sharded, _config(mistral_sharded, target, page_size=8), prompt_lengths=[8, 21, 15])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_logits_close_to_hf(llama: ModelWithAdapters, dtype: str, target: dict[str, str]) -> None:
    """In 16-bit the engine's first-step logits stay within a tolerance of HF + PEFT in the same dtype."""
    _check_half_precision_logits(llama, _config(llama, target, dtype=dtype, page_size=8), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton GEMM serves CUDA steps only")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_small_steps_on_the_triton_gemm(llama: ModelWithAdapters, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With its width floor lowered to the test model's, a step of up to 16 rows runs its projections on the Triton
    GEMM (kernels/triton/projection.py), and the logits stay within the 16-bit tolerance of HF + PEFT."""
    monkeypatch.setattr(projection, "MIN_FEATURES", 16)
    target = {"device": "cuda", "kernel_backend": "triton", "dtype": dtype}
    engine = _check_half_precision_logits(llama, _config(llama, target, dtype=dtype, page_size=8), dtype)
    assert engine.model.ops.projections._launches, "no projection took the Triton GEMM"  # type: ignore[attr-defined]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton GEMM serves CUDA steps only")
def test_decode_graphs_replay_the_triton_gemm(llama: ModelWithAdapters, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps of a few requests replayed as CUDA graphs, their projections on the Triton GEMM, give the
    greedy tokens of the same engine stepping eagerly."""
    monkeypatch.setattr(projection, "MIN_FEATURES", 16)
    target = {"device": "cuda", "kernel_backend": "triton", "dtype": "bfloat16"}
    adapters = [None, "r3-all", "r8-mlp"]
    runs = []
    for graphs in (False, True):
        engine = LLMEngine(_config(llama, target, page_size=8, cuda_graphs=graphs))
        prompts = _prompts(engine.spec.vocab_size, [5, 17, 9], seed=5)
        runs.append([r.token_ids for r in engine.generate(prompts, adapters, GREEDY)])
        assert engine.model.ops.projections._launches  # type: ignore[attr-defined]
    assert runs[0] == runs[1]


def _check_half_precision_logits(llama: ModelWithAdapters, config: EngineConfig, dtype: str) -> LLMEngine:
    torch_dtype = getattr(torch, dtype)
    device = config.torch_device()
    engine = LLMEngine(config)
    captured: list[torch.Tensor] = []
    engine.runner.logits_hook = lambda x: captured.append(x.clone())  # graphs reuse one logits buffer
    prompt = _prompts(engine.spec.vocab_size, [13], seed=3)[0]
    for adapter in (None, "r3-all", "r8-mlp"):
        captured.clear()
        engine.generate([prompt], [adapter], SamplingParams(max_tokens=1, temperature=0.0))
        ref_model = hf_reference(llama.base, llama.adapter_root / adapter if adapter else None, torch_dtype)
        with torch.inference_mode():
            ref = ref_model.to(device)(input_ids=torch.tensor([prompt], device=device)).logits[0, -1].float()
        torch.testing.assert_close(captured[0][0].cpu(), ref.cpu(), atol=0.05, rtol=0.05)
    return engine
