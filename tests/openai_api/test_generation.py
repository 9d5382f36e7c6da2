"""Greedy text through the official openai client equals the ensemble's and HF + PEFT's; streams and usage agree."""

from __future__ import annotations

from typing import Any

import pytest

from tests.openai_api.conftest import BASE, HFReference, OpenAIServer
from tests.serving.triton_calls import run_one, text_inputs

pytestmark = pytest.mark.server

MAX_TOKENS = 8
TIE_MARGIN = 1e-3  # CPU float32: a top-2 gap this small could flip between two exact implementations
PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"
ADAPTERS = [None, "demo-qv-r4"]  # the base model and a demo adapter


def _model(adapter: str | None) -> str:
    return adapter or BASE


def _expected(hf: HFReference, tokenizer: Any, ids: list[int], adapter: str | None) -> tuple[str, str, int]:
    """HF's greedy text, finish_reason and token count for `ids`, up to its first EOS (which counts as a token)."""
    trace = hf.greedy(ids, adapter, MAX_TOKENS)
    eos = {2, tokenizer.eos_token_id}
    end = next((i for i, t in enumerate(trace.tokens) if t in eos), None)
    compared = trace.margins[: MAX_TOKENS if end is None else end + 1]
    assert min(compared) > TIE_MARGIN, f"near tie in the reference ({min(compared):.3g}): pick another prompt"
    if end is None:
        return tokenizer.decode(trace.tokens, skip_special_tokens=True), "length", MAX_TOKENS
    return tokenizer.decode(trace.tokens[:end], skip_special_tokens=True), "stop", end + 1


def _ensemble(server: OpenAIServer, prompt: str, adapter: str | None, **parameters: Any) -> str:
    sampling = {"temperature": 0, "max_tokens": MAX_TOKENS}
    got = run_one(server.grpc_url, "ensemble", text_inputs(prompt, False, sampling, adapter, exclude_input=True),
                  parameters=parameters or None)  # fmt: skip
    assert got.error is None, got.error
    return got.text


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_completion_equals_ensemble_and_hf_peft(
    openai_server: OpenAIServer, hf: HFReference, tokenizer: Any, adapter: str | None
) -> None:
    client = openai_server.client()
    got = client.completions.create(model=_model(adapter), prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    text, reason, count = _expected(hf, tokenizer, ids, adapter)
    assert got.choices[0].text == text == _ensemble(openai_server, PROMPT, adapter)
    assert got.choices[0].finish_reason == reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), count)
    assert got.usage.total_tokens == len(ids) + count
    assert got.model == _model(adapter) and got.object == "text_completion"


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_chat_equals_ensemble_chat_template_and_hf_peft(
    openai_server: OpenAIServer, hf: HFReference, tokenizer: Any, adapter: str | None
) -> None:
    client = openai_server.client()
    messages = [{"role": "user", "content": QUESTION}]
    got = client.chat.completions.create(model=_model(adapter), messages=messages, max_tokens=MAX_TOKENS,
                                         temperature=0)  # fmt: skip
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    text, reason, count = _expected(hf, tokenizer, ids, adapter)
    # The ensemble renders the same single user message in slora: the two renderings agree.
    assert got.choices[0].message.content == text == _ensemble(openai_server, QUESTION, adapter,
                                                               apply_chat_template=True)  # fmt: skip
    assert got.choices[0].message.role == "assistant" and got.choices[0].finish_reason == reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), count)


def test_chat_renders_the_whole_conversation(openai_server: OpenAIServer, tokenizer: Any) -> None:
    """System, user, assistant, user (a text-part list too): one rendering of all of it, tokenized once in slora."""
    messages = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": [{"type": "text", "text": "Name a fruit."}]},
    ]
    got = openai_server.client().chat.completions.create(
        model="demo-all-r8", messages=messages, max_completion_tokens=MAX_TOKENS, temperature=0
    )
    plain = [{**m, "content": m["content"] if isinstance(m["content"], str) else "Name a fruit."} for m in messages]
    rendered = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    sampling = {"temperature": 0, "max_tokens": MAX_TOKENS}
    direct = run_one(openai_server.grpc_url, "slora", text_inputs(rendered, False, sampling, "demo-all-r8", True),
                     parameters={"add_special_tokens": False, "apply_chat_template": False})  # fmt: skip
    assert got.choices[0].message.content == direct.text
    assert got.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


def test_streamed_deltas_concatenate_to_the_whole_text_with_usage(openai_server: OpenAIServer) -> None:
    client = openai_server.client()
    ask = {"model": f"{BASE}_lora_demo-mlp-r16", "max_tokens": 12, "temperature": 0}  # Triton frontend's naming
    whole = client.completions.create(prompt="Write three emojis:", **ask)
    chunks = list(client.completions.create(prompt="Write three emojis:", stream=True,
                                            stream_options={"include_usage": True}, **ask))  # fmt: skip
    *texts, usage = chunks
    assert "".join(c.choices[0].text for c in texts) == whole.choices[0].text != ""
    assert texts[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in texts[:-1])
    assert usage.choices == [] and usage.usage == whole.usage
    assert all(c.usage is None for c in texts) and len({c.id for c in chunks}) == 1

    messages = [{"role": "user", "content": "Say hello in Russian."}]
    whole_chat = client.chat.completions.create(messages=messages, **ask)
    stream = list(client.chat.completions.create(messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **ask))  # fmt: skip
    first, *deltas, usage_chunk = stream
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == whole_chat.choices[0].message.content
    assert deltas[-1].choices[0].finish_reason == whole_chat.choices[0].finish_reason
    assert usage_chunk.usage == whole_chat.usage


def test_echo_stop_seed_and_token_prompts(openai_server: OpenAIServer, tokenizer: Any) -> None:
    client = openai_server.client()
    echoed = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=4, temperature=0)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    as_ids = client.completions.create(model=BASE, prompt=ids, max_tokens=4, temperature=0)
    assert as_ids.choices[0].text == plain.choices[0].text
    stopped = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=12, temperature=0, stop=["."])
    assert stopped.choices[0].finish_reason == "stop" and "." not in stopped.choices[0].text
    seeded = [client.completions.create(model="demo-o-r2", prompt="Once upon a time", max_tokens=6, temperature=0.9,
                                        top_p=0.9, seed=7, extra_body={"top_k": 40}) for _ in range(2)]  # fmt: skip
    assert seeded[0].choices[0].text == seeded[1].choices[0].text != ""
