"""Write a model directory for `load_format="dummy"`: config.json of a chosen shape, plus an optional tokenizer.

The engine makes random weights of the config's shapes, so a Llama-2-7B-shaped model needs no 13 GB checkpoint:

    python -m perf.make_model --shape llama2-7b --out /tmp/slora-perf/model
    python -m perf.make_model --shape qwen2.5-7b --out /tmp/slora-perf/qwen
    python -m perf.make_model --shape tiny --out /tmp/slora-perf/tiny      # CPU smoke runs
    python -m perf.make_model --shape llama3-8b --tiny --out /tmp/l3-tiny  # its architecture, tiny widths

Shapes (--list prints them): llama2-7b (S-LoRA's model: MHA, vocab 32000), llama3-8b (GQA 32/8 heads, vocab
128256, rope_theta 500000, context 8192), qwen2.5-7b (Qwen2ForCausalLM: GQA 28/4 heads, qkv bias, vocab 152064,
rope_theta 1e6, context 32768), llama2-13b and llama3-70b (tensor parallelism), tiny and tiny-deep (CPU smoke
runs). `--tiny` keeps a shape's architecture, bias, rope and head grouping and shrinks its widths, layers and
vocabulary (ModelShape.tiny).

The tokenizer (on by default) is a word-level one over the whole vocabulary: id i <-> the word "t<i>" (ids 0-2 are
<unk>, <s>, </s>). A prompt of token ids rendered as "t17 t923 ..." tokenizes back to exactly those ids, so the
text path of the server (the `ensemble`) receives prompts of exact lengths too.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
FIRST_WORD_ID = len(SPECIAL_TOKENS)  # prompts draw ids from [FIRST_WORD_ID, vocab)


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}  # model_type -> architecture
SIZE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "vocab_size", "max_position_embeddings")  # fmt: skip
TINY_HEAD_DIM = 16


@dataclass(frozen=True)
class ModelShape:
    """A decoder's sizes and the config fields that change its work: architecture (a model_type of ARCHITECTURES),
    qkv bias (Qwen2 always has it), rope, norm epsilon, the dtype written to config.json."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    model_type: str = "llama"
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    torch_dtype: str = "float16"

    def __post_init__(self) -> None:
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.model_type not in ARCHITECTURES:
            raise ValueError(f"model_type must be one of {', '.join(ARCHITECTURES)}, got {self.model_type!r}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ValueError("rope_theta and rms_norm_eps must be > 0")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.vocab_size <= FIRST_WORD_ID:
            raise ValueError(f"vocab_size must exceed {FIRST_WORD_ID} (the special tokens)")

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2"

    @property
    def kv_group(self) -> int:
        """Query heads per KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    def tiny(self) -> ModelShape:
        """The same architecture, bias, rope and query heads per KV head, at CPU sizes: heads of 16 dimensions, at
        least 4 query heads, 2 layers, vocabulary 1024."""
        kv_heads = max(1, 4 // self.kv_group)
        heads = kv_heads * self.kv_group
        return replace(self, hidden_size=heads * TINY_HEAD_DIM, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=1024,
                       max_position_embeddings=2048)  # fmt: skip


# Llama-2-7B: the model of S-LoRA's S1/S2 settings.
LLAMA2_7B = ModelShape(4096, 11008, 32, 32, 32, 32000, 4096)
# Meta-Llama-3-8B's config.json (no rope scaling: that came with Llama 3.1).
LLAMA3_8B = ModelShape(4096, 14336, 32, 32, 8, 128256, 8192, rope_theta=500000.0, torch_dtype="bfloat16")
# Qwen2.5-7B(-Instruct)'s config.json: sliding window off, untied embeddings.
QWEN25_7B = ModelShape(3584, 18944, 28, 28, 4, 152064, 32768, model_type="qwen2", rope_theta=1e6, rms_norm_eps=1e-6,
                       torch_dtype="bfloat16")  # fmt: skip

# Tensor-parallel shapes (issue 30): Llama-2-13B's config.json, and Llama-3-70B's (GQA with 8 KV heads: at 8 ranks one
# head each, whose pages then need page_size >= 32 to hold a hidden-wide lora_A row, backend/parallel/adapter_shard.py).
LLAMA2_13B = ModelShape(5120, 13824, 40, 40, 40, 32000, 4096)
LLAMA3_70B = ModelShape(8192, 28672, 80, 64, 8, 128256, 8192, rope_theta=500000.0, torch_dtype="bfloat16")

SHAPES = {
    "llama2-7b": LLAMA2_7B,
    "llama2-13b": LLAMA2_13B,
    "llama3-70b": LLAMA3_70B,
    "llama3-8b": LLAMA3_8B,
    "qwen2.5-7b": QWEN25_7B,
    # Small enough for CPU smoke runs, large enough for prompts of up to 512 + 512 tokens. page_size 16 gives
    # pages of 16 x 2 x 2 x 16 = 1024 elements, wider than any row (64 hidden, 128 intermediate).
    "tiny": ModelShape(64, 128, 2, 4, 2, 1024, 2048),
    # tiny's widths with Llama-2-7B's 32 layers: the host work of a step (launches per layer) at its real count.
    "tiny-deep": ModelShape(64, 128, 32, 4, 2, 1024, 2048),
}


def config_json(shape: ModelShape) -> dict[str, Any]:
    """A Hugging Face config.json; bos/eos are the word tokenizer's (the real models' ids exceed its specials)."""
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[shape.model_type]],
        **asdict(shape),
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if shape.model_type == "qwen2":  # the bias is implied by the architecture; no sliding window, as Qwen2.5 ships
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=shape.num_hidden_layers)
    else:
        config.update(attention_bias=False, mlp_bias=False)
    return config


def write_model_dir(shape: ModelShape, out: Path, tokenizer: bool = True) -> Path:
    """Create `out` with config.json (and tokenizer files); returns `out`. Existing files are replaced."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_json(shape), indent=2) + "\n")
    if tokenizer:
        write_word_tokenizer(shape.vocab_size, out)
    logger.info("wrote %s (%s, hidden %d, %d layers, %d/%d heads, vocab %d)", out, shape.model_type,
                shape.hidden_size, shape.num_hidden_layers, shape.num_attention_heads, shape.num_key_value_heads,
                shape.vocab_size)  # fmt: skip
    return out


def word(token_id: int) -> str:
    return SPECIAL_TOKENS[token_id] if token_id < FIRST_WORD_ID else f"t{token_id}"


def ids_to_text(ids: list[int]) -> str:
    """The text that the word-level tokenizer encodes back to exactly `ids`."""
    return " ".join(word(i) for i in ids)


def write_word_tokenizer(vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {word(i): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20, **special}) + "\n"
    )
    (out / "special_tokens_map.json").write_text(json.dumps(special) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    parser.add_argument("--tiny", action="store_true", help="the shape's architecture at CPU sizes (ModelShape.tiny)")
    parser.add_argument("--out", type=Path, help="model directory to write")
    parser.add_argument("--list", action="store_true", help="log every shape and stop")
    parser.add_argument("--no-tokenizer", action="store_true", help="config.json only: prompts must be token ids")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.list:
        for name, shape in sorted(SHAPES.items()):
            logger.info("%-11s %s", name, shape)
        return
    if args.out is None:
        parser.error("--out is required")
    shape = SHAPES[args.shape].tiny() if args.tiny else SHAPES[args.shape]
    write_model_dir(shape, args.out, tokenizer=not args.no_tokenizer)


if __name__ == "__main__":
    main()
