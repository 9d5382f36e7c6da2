"""The embedded SmolLM2-135M-Instruct: adapters in one batch equal HF + PEFT, and it answers real questions."""

from __future__ import annotations

from pathlib import Path

import pytest

from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.sampling_params import SamplingParams
from tests.factories import AdapterSpec, hf_reference, save_adapter
from tests.model_fixtures import TARGETS
from tests.reference import compare_greedy, hf_greedy

ADAPTERS = (
    AdapterSpec("s-r1", 1, ("q_proj", "v_proj"), alpha=2),
    AdapterSpec("s-r5-mlp", 5, ("gate_proj", "up_proj", "down_proj"), alpha=5),
    AdapterSpec(
        "s-r8-all",
        8,
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        alpha=4,
        rslora=True,
    ),  # fmt: skip
    AdapterSpec("s-r16-o", 16, ("o_proj", "k_proj"), alpha=16),
    AdapterSpec("s-r3-down", 3, ("down_proj",), alpha=9),
    AdapterSpec("s-r64-qv", 64, ("q_proj", "v_proj"), alpha=32, rslora=True),
)
MAX_NEW = 10


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> tuple[Path, Path]:
    base = default_model_dir
    root = tmp_path_factory.mktemp("smol-adapters")
    for i, spec in enumerate(ADAPTERS):
        save_adapter(base, spec, root, seed=50 + i)
    return base, root


@pytest.fixture(scope="module", params=TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
def engine(smollm2: tuple[Path, Path], request: pytest.FixtureRequest) -> LLMEngine:
    _, root = smollm2
    device, backend = request.param
    config = EngineConfig(model="default", adapter_root=str(root), pool_bytes=256 << 20, device=device,
                          dtype="float32", kernel_backend=backend)  # fmt: skip
    return LLMEngine(config)


def test_answers_a_real_question(engine: LLMEngine) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    [result] = engine.generate([prompt], None, SamplingParams(max_tokens=20, temperature=0.0))
    assert "Paris" in result.text
    assert result.finish_reason == "stop"  # ends with <|im_end|>, which is not in the text
    assert "<|im_end|>" not in result.text


def test_all_adapters_with_base_in_one_batch_equal_hf_peft(engine: LLMEngine, smollm2: tuple[Path, Path]) -> None:
    base, root = smollm2
    tok = engine.tokenizer
    prompts = [tok.encode(t) for t in ("The quick brown fox", "def fibonacci(n):", "Paris is a city in")]
    jobs = [(prompts[i % len(prompts)], name) for i, name in enumerate([None, *[a.name for a in ADAPTERS]])]
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    results = engine.generate([p for p, _ in jobs], [a for _, a in jobs], greedy)
    compared = 0
    for (prompt, adapter), result in zip(jobs, results):
        ref = hf_greedy(hf_reference(base, root / adapter if adapter else None), prompt, MAX_NEW)
        compared += compare_greedy(result.token_ids, ref, tie_margin=1e-3)
    assert compared >= 0.9 * MAX_NEW * len(jobs)
    base_only = engine.generate([p for p, _ in jobs], None, greedy)
    changed = sum(r.token_ids != b.token_ids for r, b in zip(results[1:], base_only[1:]))
    assert changed >= len(ADAPTERS) - 1, "the adapters should change the greedy output"
    engine.check_idle_integrity()
