"""Prompts for genai-perf's --input-file (JSONL, one {"text": ...} a line) in the words of perf/make_model.py's
word-level tokenizer, so that each prompt is exactly `length` tokens of the random-weight model.

genai-perf's synthetic prompts are cut from an English corpus, which that tokenizer reads as unknown words and
decodes to nothing: the server refuses them as empty prompts.

    python -m perf.word_prompts --vocab 32000 --count 256 --length 128 --out prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from perf.make_model import FIRST_WORD_ID, ids_to_text


def word_prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[str]:
    """`count` prompts of `length` random words of the tokenizer's vocabulary (no special tokens)."""
    if vocab <= FIRST_WORD_ID or count < 1 or length < 1:
        raise ValueError(f"need vocab > {FIRST_WORD_ID}, count >= 1 and length >= 1 (got {vocab}, {count}, {length})")
    rng = random.Random(seed)
    return [ids_to_text([rng.randrange(FIRST_WORD_ID, vocab) for _ in range(length)]) for _ in range(count)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--vocab", type=int, required=True, help="the model's vocab_size")
    parser.add_argument("--count", type=int, default=256)
    parser.add_argument("--length", type=int, default=128, help="tokens a prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    prompts = word_prompts(args.vocab, args.count, args.length, args.seed)
    args.out.write_text("".join(json.dumps({"text": p}) + "\n" for p in prompts))


if __name__ == "__main__":
    main()
