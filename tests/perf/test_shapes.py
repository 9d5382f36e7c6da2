"""The shapes users run today (perf/make_model.py): their configs read as the published models, and a tiny version of
each (same architecture, bias, rope, head grouping) serves make_adapters' adapters on CPU exactly as HF + PEFT."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from perf.make_adapters import SETTINGS, make_adapters
from perf.make_model import SHAPES, write_model_dir
from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.model.spec import ModelSpec

NEW_SHAPES = ("llama3-8b", "qwen2.5-7b")
PROMPT = [5, 17, 300, 42, 999, 7]
ADAPTERS = (None, "sall-0000", "sall-0001", "s1-0000")


def test_full_size_configs_read_as_the_published_models(tmp_path: Path) -> None:
    llama = ModelSpec.from_dir(write_model_dir(SHAPES["llama3-8b"], tmp_path / "llama", tokenizer=False))
    assert llama.architecture == "LlamaForCausalLM" and not llama.qkv_bias
    assert (llama.hidden_size, llama.intermediate_size, llama.num_layers, llama.num_heads, llama.num_kv_heads,
            llama.vocab_size, llama.max_position_embeddings) == (4096, 14336, 32, 32, 8, 128256, 8192)  # fmt: skip
    assert llama.rope.theta == 500000.0 and llama.rope.rope_type == "default" and llama.head_dim == 128
    qwen = ModelSpec.from_dir(write_model_dir(SHAPES["qwen2.5-7b"], tmp_path / "qwen", tokenizer=False))
    assert qwen.architecture == "Qwen2ForCausalLM" and qwen.qkv_bias and qwen.sliding_window is None
    assert (qwen.hidden_size, qwen.intermediate_size, qwen.num_layers, qwen.num_heads, qwen.num_kv_heads,
            qwen.vocab_size, qwen.max_position_embeddings) == (3584, 18944, 28, 28, 4, 152064, 32768)  # fmt: skip
    assert qwen.rope.theta == 1e6 and qwen.rms_norm_eps == 1e-6 and not qwen.tie_word_embeddings
    assert json.loads((tmp_path / "qwen" / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("shape", NEW_SHAPES)
def test_tiny_version_keeps_the_architecture(shape: str) -> None:
    full, tiny = SHAPES[shape], SHAPES[shape].tiny()
    assert (tiny.model_type, tiny.qkv_bias, tiny.rope_theta, tiny.rms_norm_eps, tiny.kv_group) == (
        full.model_type, full.qkv_bias, full.rope_theta, full.rms_norm_eps, full.kv_group,
    )  # fmt: skip
    assert tiny.hidden_size <= 112 and tiny.num_hidden_layers == 2


def _checkpoint(shape: str, out: Path) -> tuple[Path, torch.nn.Module]:
    """The tiny version's config.json, with random HF weights (nonzero biases, so Qwen2's matter) as safetensors."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = write_model_dir(SHAPES[shape].tiny(), out)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.1)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(model_dir / "model.safetensors"))
    return model_dir, model


def _peft_greedy(model: torch.nn.Module, root: Path, name: str | None, tokens: int) -> list[int]:
    from peft import PeftModel

    with torch.no_grad():
        runner = model if name is None else PeftModel.from_pretrained(model, str(root / name)).eval()
        out = runner.generate(torch.tensor([PROMPT]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        if name is not None:
            runner.unload()
    return list(out[0, len(PROMPT) :].tolist())


@pytest.mark.parametrize("shape", NEW_SHAPES)
def test_tiny_version_serves_generated_adapters_like_peft(shape: str, tmp_path: Path) -> None:
    model_dir, hf_model = _checkpoint(shape, tmp_path / "model")
    root = tmp_path / "adapters"
    make_adapters(model_dir, SETTINGS["Sall"], 2, root, distinct=2, progress=False)
    make_adapters(model_dir, SETTINGS["S1"], 1, root, distinct=1, progress=False)
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", adapter_root=str(root)))
    assert engine.spec.architecture == ("Qwen2ForCausalLM" if shape.startswith("qwen") else "LlamaForCausalLM")
    assert engine.spec.qkv_bias == shape.startswith("qwen")
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    served = [list(c.token_ids) for c in engine.generate([PROMPT] * len(ADAPTERS), list(ADAPTERS), greedy)]
    assert served == [_peft_greedy(hf_model, root, name, 8) for name in ADAPTERS]
    assert len({tuple(tokens) for tokens in served}) > 1, "the adapters change the tokens"


@pytest.mark.parametrize("shape", NEW_SHAPES)
def test_tiny_version_with_random_weights_generates(shape: str, tmp_path: Path) -> None:
    """load_format=dummy, as the benchmarks run: random weights of the config's shapes."""
    model_dir = write_model_dir(SHAPES[shape].tiny(), tmp_path / "model")
    make_adapters(model_dir, SETTINGS["S2"], 4, tmp_path / "adapters", distinct=1, progress=False)
    engine = LLMEngine(EngineConfig(model=str(model_dir), load_format="dummy", device="cpu",
                                    adapter_root=str(tmp_path / "adapters")))  # fmt: skip
    names = [f"s2-000{i}" for i in range(4)]
    done = engine.generate([PROMPT] * 4, names, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert [len(c.token_ids) for c in done] == [5] * 4 and {c.finish_reason for c in done} == {"length"}
