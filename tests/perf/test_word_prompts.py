"""perf.word_prompts: genai-perf input lines that make_model's word tokenizer reads back as `length` tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perf.make_model import FIRST_WORD_ID, write_word_tokenizer
from perf.word_prompts import main, word_prompts

pytest.importorskip("tokenizers")


def test_prompts_are_exactly_length_tokens_of_the_word_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    write_word_tokenizer(500, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    out = tmp_path / "prompts.jsonl"
    main(["--vocab", "500", "--count", "5", "--length", "7", "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 5 and len({line["text"] for line in lines}) == 5
    for line in lines:
        ids = tokenizer(line["text"], add_special_tokens=False)["input_ids"]
        assert len(ids) == 7 and all(FIRST_WORD_ID <= i < 500 for i in ids), ids
    assert word_prompts(500, 5, 7) == [line["text"] for line in lines]  # seeded


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="vocab"):
        word_prompts(FIRST_WORD_ID, 1, 1)
    with pytest.raises(ValueError, match="length"):
        word_prompts(100, 1, 0)
