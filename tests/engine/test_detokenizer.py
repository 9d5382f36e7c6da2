"""Incremental detokenization: deltas concatenate to the full text, stop strings and split characters held back."""

from __future__ import annotations

import random

import pytest

from slora.backend.engine.detokenizer import IncrementalDetokenizer

SAMPLES = [
    "Hello, world! How are you today?",
    "Emoji: 🤖🚀 and accents: déjà vu, naïve, Ærø",
    "中文文本和日本語のテキスト, mixed with English.",
    "code:\n    def f(x):\n        return x ** 2\n\n",
]


def _stream(tokenizer, prompt: list[int], output: list[int], stop: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    detok = IncrementalDetokenizer(tokenizer, prompt, stop)
    ids = list(prompt)
    deltas = []
    for i, token in enumerate(output):
        ids.append(token)
        detok.update(ids)
        deltas.append(detok.take(final=detok.stopped or i == len(output) - 1))
        if detok.stopped:
            break
    return deltas, detok


@pytest.mark.parametrize("sample", SAMPLES)
def test_deltas_concatenate_to_full_decode(tokenizer, sample: str) -> None:  # type: ignore[no-untyped-def]
    prompt = tokenizer.encode("Answer:")
    output = tokenizer.encode(sample)
    deltas, _ = _stream(tokenizer, prompt, output)
    assert "".join(deltas) == tokenizer.decode(output, skip_special_tokens=True)


def test_split_multibyte_characters_are_held_back(tokenizer) -> None:  # type: ignore[no-untyped-def]
    output = tokenizer.encode("🤖🤖🤖")
    assert len(output) > 3, "each emoji should span several byte tokens"
    deltas, _ = _stream(tokenizer, tokenizer.encode("x"), output)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "🤖🤖🤖"


def test_random_token_streams(tokenizer) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(0)
    for _ in range(30):
        output = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 25))]
        deltas, detok = _stream(tokenizer, [rng.randrange(1000) for _ in range(4)], output)
        assert "".join(deltas) == detok.text


@pytest.mark.parametrize(("stop", "expected"), [(("world",), "Hello, "), (("o",), "Hell"), ((", w", "xyz"), "Hello")])
def test_stop_strings_never_stream_past_the_stop(tokenizer, stop: tuple[str, ...], expected: str) -> None:  # type: ignore[no-untyped-def]
    output = tokenizer.encode("Hello, world and more text after it")
    deltas, detok = _stream(tokenizer, tokenizer.encode("Say:"), output, stop)
    assert detok.stopped and detok.text == expected
    assert "".join(deltas) == expected
