"""Write a model directory for `load_format="dummy"`: config.json of a chosen shape, plus an optional tokenizer.

The engine makes random weights of the config's shapes, so a Llama-2-7B-shaped model needs no 13 GB checkpoint:

    python -m perf.make_model --shape llama2-7b --out /tmp/slora-perf/model
    python -m perf.make_model --shape tiny --out /tmp/slora-perf/tiny      # CPU smoke runs

The tokenizer (on by default) is a word-level one over the whole vocabulary: id i <-> the word "t<i>" (ids 0-2 are
<unk>, <s>, </s>). A prompt of token ids rendered as "t17 t923 ..." tokenizes back to exactly those ids, so the
text path of the server (the `ensemble`) receives prompts of exact lengths too.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
FIRST_WORD_ID = len(SPECIAL_TOKENS)  # prompts draw ids from [FIRST_WORD_ID, vocab)


@dataclass(frozen=True)
class ModelShape:
    """A Llama architecture's sizes; everything else in config.json is fixed (Llama-2 defaults)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.vocab_size <= FIRST_WORD_ID:
            raise ValueError(f"vocab_size must exceed {FIRST_WORD_ID} (the special tokens)")


SHAPES = {
    # Llama-2-7B: the model of S-LoRA's S1/S2 settings.
    "llama2-7b": ModelShape(4096, 11008, 32, 32, 32, 32000, 4096),
    # Small enough for CPU smoke runs, large enough for prompts of up to 512 + 512 tokens. page_size 16 gives
    # pages of 16 x 2 x 2 x 16 = 1024 elements, wider than any row (64 hidden, 128 intermediate).
    "tiny": ModelShape(64, 128, 2, 4, 2, 1024, 2048),
    # tiny's widths with Llama-2-7B's 32 layers: the host work of a step (launches per layer) at its real count.
    "tiny-deep": ModelShape(64, 128, 32, 4, 2, 1024, 2048),
}


def config_json(shape: ModelShape) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **asdict(shape),
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float16",
    }


def write_model_dir(shape: ModelShape, out: Path, tokenizer: bool = True) -> Path:
    """Create `out` with config.json (and tokenizer files); returns `out`. Existing files are replaced."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_json(shape), indent=2) + "\n")
    if tokenizer:
        write_word_tokenizer(shape.vocab_size, out)
    logger.info("wrote %s (hidden %d, %d layers, vocab %d)", out, shape.hidden_size, shape.num_hidden_layers,
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
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--no-tokenizer", action="store_true", help="config.json only: prompts must be token ids")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    write_model_dir(SHAPES[args.shape], args.out, tokenizer=not args.no_tokenizer)


if __name__ == "__main__":
    main()
