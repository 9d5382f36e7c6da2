"""Builders for the tests: small random HF checkpoints (Llama with GQA, Qwen2 with qkv bias) and PEFT adapters.

Everything is written to disk in the formats users have (save_pretrained), so the engine is tested on the same
loading path as in production, and HF transformers + PEFT serve as the independent reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    targets: tuple[str, ...]
    alpha: float = 16.0
    rslora: bool = False
    rank_pattern: dict[str, int] | None = None
    alpha_pattern: dict[str, float] | None = None


# Six+ adapters: ranks 1 and odd ones, attention-only and MLP-only targets, rslora, per-module patterns.
MIXED_ADAPTERS = (
    AdapterSpec("r1-qv", 1, ("q_proj", "v_proj"), alpha=4),
    AdapterSpec("r3-all", 3, ALL_MODULES, alpha=6, rslora=True),
    AdapterSpec("r8-mlp", 8, ("gate_proj", "up_proj", "down_proj"), alpha=16),
    AdapterSpec("r5-ko", 5, ("k_proj", "o_proj"), alpha=10),
    AdapterSpec("r16-all", 16, ALL_MODULES, alpha=8, rslora=True),
    AdapterSpec(
        "r2-down", 2, ("down_proj", "q_proj"), alpha=3, rank_pattern={"down_proj": 7}, alpha_pattern={"q_proj": 9}
    ),  # fmt: skip
    AdapterSpec("r12-qkv", 12, ("q_proj", "k_proj", "v_proj"), alpha=24),
)


def tiny_llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    values = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def tiny_qwen2_config(**overrides: Any) -> Any:
    from transformers import Qwen2Config

    values = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        use_sliding_window=False,
    )
    values.update(overrides)
    return Qwen2Config(**values)


def tiny_mistral_config(**overrides: Any) -> Any:
    from transformers import MistralConfig

    values = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=64,
        tie_word_embeddings=False,
    )
    values.update(overrides)
    return MistralConfig(**values)


def save_random_model(config: Any, path: Path, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """A randomly initialized causal LM saved with safetensors; biases made nonzero so they matter."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    if max_shard_size:
        model.save_pretrained(str(path), safe_serialization=True, max_shard_size=max_shard_size)
    else:
        model.save_pretrained(str(path), safe_serialization=True)
    return path


def save_adapter(base_path: Path, spec: AdapterSpec, out_dir: Path, seed: int) -> Path:
    """A PEFT LoRA adapter with random A and nonzero random B (init_lora_weights=False)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        use_rslora=spec.rslora,
        rank_pattern=spec.rank_pattern or {},
        alpha_pattern=spec.alpha_pattern or {},
        init_lora_weights=False,
    )
    model = get_peft_model(base, config)
    path = out_dir / spec.name
    model.save_pretrained(str(path))
    return path


def hf_reference(base_path: Path, adapter_path: Path | None, dtype: torch.dtype = torch.float32) -> Any:
    """The HF (+ PEFT) model the engine must agree with."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=dtype).eval()
    if adapter_path is not None:
        model = PeftModel.from_pretrained(model, str(adapter_path)).eval()
    return model
