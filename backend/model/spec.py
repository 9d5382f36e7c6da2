"""The architecture of a supported base model, read once from a Hugging Face config.json."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slora.backend.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# The seven projections a LoRA adapter may target, in the order used by every LoRA table of the engine.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and options of a Llama-family decoder (Llama, Mistral, Qwen2)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of one LoRA-targetable projection."""
        shapes = {
            "q_proj": (self.hidden_size, self.q_size),
            "k_proj": (self.hidden_size, self.kv_size),
            "v_proj": (self.hidden_size, self.kv_size),
            "o_proj": (self.q_size, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }
        if module not in shapes:
            raise KeyError(module)
        return shapes[module]

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelSpec:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(f"{config_file}: missing (a model directory needs config.json)")
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{config_file}: not valid JSON ({exc})") from exc
        return cls.from_config(config, source=str(config_file))

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str = "config.json") -> ModelSpec:
        architecture = _architecture(config, source)
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
        window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
        return cls(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=_rope_spec(config, source),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=architecture == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False)),
            sliding_window=int(window) if window else None,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _architecture(config: dict[str, Any], source: str) -> str:
    names = config.get("architectures") or []
    by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return str(name)
    model_type = config.get("model_type")
    if not names and model_type in by_type:
        return by_type[model_type]
    raise ModelLoadError(
        f"{source}: architecture {names or model_type!r} is not supported "
        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
    )


def _rope_spec(config: dict[str, Any], source: str) -> RopeSpec:
    # transformers >= 5 writes `rope_parameters`; older checkpoints write `rope_theta` + `rope_scaling`.
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor != 1 is not supported")
    factor = float(params.get("factor", 1.0))
    if not math.isfinite(factor) or factor <= 0:
        raise ModelLoadError(f"{source}: rope factor must be > 0, got {factor}")
    return RopeSpec(
        theta=theta,
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", config.get("max_position_embeddings", 8192))
        ),
    )
