"""Sampling parameters: validation, filters against an independent reference, seeds, stop conditions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.errors import InvalidRequestError
from slora.backend.executor.sampler import filtered_probs, sample


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"temperature": -1}, "'temperature' must be >= 0"),
        ({"temperature": "hot"}, "'temperature' must be a finite number"),
        ({"temperature": float("nan")}, "'temperature' must be a finite number"),
        ({"top_p": 0}, "'top_p' must be in"),
        ({"top_p": 1.5}, "'top_p' must be in"),
        ({"top_k": -2}, "'top_k' must be >= -1"),
        ({"top_k": 2.5}, "'top_k' must be an integer"),
        ({"max_tokens": 0}, "'max_tokens' must be >= 1"),
        ({"max_tokens": "5"}, "'max_tokens' must be an integer"),
        ({"max_tokens": True}, "'max_tokens' must be an integer"),
        ({"seed": -3}, "'seed' must be >= 0"),
        ({"seed": 2**64}, "'seed' must be <= 18446744073709551615"),  # was "Overflow when unpacking long long"
        ({"seed": 10**30}, "'seed' must be <="),
        ({"seed": 1.5}, "'seed' must be an integer"),
        ({"seed": "7"}, "'seed' must be an integer"),
        ({"seed": True}, "'seed' must be an integer"),
        ({"stop": [""]}, "'stop'"),
        ({"stop": 5}, "'stop'"),
        ({"stop_token_ids": ["a"]}, "'stop_token_ids'"),
        ({"ignore_eos": "yes"}, "'ignore_eos'"),
        ({"temprature": 0.5}, "unknown sampling parameter 'temprature'"),
        ({"presence_penalty": 0.5}, "'presence_penalty'=0.5 is not supported"),
    ],
)
def test_bad_values_name_the_field(values: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams.from_dict(values)


def test_vllm_style_dict_accepted() -> None:
    params = SamplingParams.from_dict(
        {"temperature": 0, "top_k": 0, "top_p": 1, "max_tokens": 7, "stop": "\n", "presence_penalty": 0, "n": 1}
    )
    assert params.greedy and params.top_k == -1 and params.stop == ("\n",) and params.max_tokens == 7
    with pytest.raises(InvalidRequestError, match="JSON object"):
        SamplingParams.from_dict([1, 2])  # type: ignore[arg-type]


def _reference_support(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> set[int]:
    """Tokens allowed after top-k then top-p, computed by sorting the probabilities in Python."""
    probs = torch.softmax(logits.double() / temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if top_k > 0:
        order = order[:top_k]
    kept = [probs[i] for i in order]
    total = sum(kept)
    allowed, mass = set(), 0.0
    for i, p in zip(order, kept):
        allowed.add(i)
        mass += p / total
        if mass >= top_p:
            break
    return allowed


@pytest.mark.parametrize(("top_k", "top_p"), [(-1, 1.0), (5, 1.0), (-1, 0.3), (8, 0.6), (1, 1.0), (-1, 0.999)])
def test_filters_match_reference(top_k: int, top_p: float) -> None:
    generator = torch.Generator().manual_seed(top_k * 100 + int(top_p * 10))
    for _ in range(20):
        logits = torch.randn(50, generator=generator) * 3
        params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p)
        probs = filtered_probs(logits, params)
        support = {int(i) for i in torch.nonzero(probs > 0).flatten()}
        assert support == _reference_support(logits, 0.7, top_k, top_p)
        assert probs.sum().item() == pytest.approx(1.0, abs=1e-5)


def test_draws_follow_the_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[sample(logits, [params], [generator])[0]] += 1
    expected = torch.softmax(logits[0], dim=-1) * 4000
    assert torch.all((counts - expected).abs() < 5 * expected.sqrt() + 5)


@pytest.fixture(scope="module")
def engine(tiny_text_model: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_text_model), page_size=8, pool_bytes=64 << 20))


def test_the_largest_seed_is_served(engine: LLMEngine) -> None:
    largest = SamplingParams(max_tokens=4, temperature=1.0, seed=2**64 - 1, ignore_eos=True)
    assert len(engine.generate(["Once upon a time"], None, largest)[0].token_ids) == 4
    with pytest.raises(InvalidRequestError, match="'seed'"):
        engine.prepare("Once upon a time", None, {"seed": 2**64})


def test_seed_reproducible_whatever_the_batch(engine: LLMEngine) -> None:
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    alone = engine.generate(["Once upon a time"], None, seeded)[0].token_ids
    others = SamplingParams(max_tokens=12, temperature=1.3, ignore_eos=True)
    crowd = engine.generate(["Hello", "Once upon a time", "abc def"], None, [others, seeded, others])
    assert crowd[1].token_ids == alone
    unseeded = engine.generate(["Once upon a time"] * 2, None, SamplingParams(max_tokens=12, ignore_eos=True))
    assert unseeded[0].token_ids != unseeded[1].token_ids


def test_max_tokens_and_stop_token_ids(engine: LLMEngine) -> None:
    greedy = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    [free] = engine.generate(["The weather"], None, greedy)
    assert len(free.token_ids) == 9 and free.finish_reason == "length"
    stop_at = free.token_ids[4]
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_at,))
    [stopped] = engine.generate(["The weather"], None, params)
    first = free.token_ids.index(stop_at)
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"


def test_stop_strings_cut_text_and_streams_concatenate(engine: LLMEngine) -> None:
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    [free] = engine.generate(["Tell me"], None, greedy)
    assert len(free.text) > 6
    stop = free.text[3:6]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=(stop, "never-there"))
    pieces = list(engine.stream("Tell me", None, params))
    text = "".join(p.text for p in pieces)
    assert text == free.text[: free.text.index(stop)]
    assert pieces[-1].finished and pieces[-1].finish_reason == "stop"


def test_eos_ends_unless_ignored(engine: LLMEngine) -> None:
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    [free] = engine.generate(["Hi there"], None, greedy)
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({free.token_ids[3]})  # pretend the 4th greedy token is the model's EOS
    try:
        [stopped] = engine.generate(["Hi there"], None, SamplingParams(max_tokens=10, temperature=0.0))
        [ignored] = engine.generate(["Hi there"], None, greedy)
    finally:
        engine.eos_token_ids = saved
    first = free.token_ids.index(free.token_ids[3])
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_token_only_requests_skip_the_text(engine: LLMEngine) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    [with_text] = engine.generate(["Tell me"], None, greedy)
    request = engine.prepare("Tell me", None, greedy, detokenize=False)
    assert request.detokenizer is None
    engine.submit(request)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [t for o in outputs for t in o.new_token_ids] == with_text.token_ids
    assert all(o.text == "" for o in outputs)
    stop = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=("zz",))
    assert engine.prepare("Tell me", None, stop, detokenize=False).detokenizer is not None  # stop strings need text
