"""/v1/models follows runtime loads and unloads; each documented error has its status, format and field."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from slora.client.admin import adapter_command
from tests.openai_api.conftest import BASE, MAX_NUM_SEQS, MAX_WAITING, OpenAIServer

pytestmark = pytest.mark.server


def _models(server: OpenAIServer) -> dict[str, Any]:
    return {m.id: m for m in server.client().models.list().data}


def _wait_for(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the model list did not change in time"
        time.sleep(0.2)


def _listing_with(server: OpenAIServer, name: str) -> dict[str, Any]:
    """The first model listing that holds `name`."""
    deadline = time.monotonic() + 30
    while name not in (models := _models(server)):
        assert time.monotonic() < deadline, f"{name} did not appear in the model list in time"
        time.sleep(0.2)
    return models


def test_models_list_the_base_and_every_adapter_with_tier_and_rank(openai_server: OpenAIServer) -> None:
    client = openai_server.client()
    client.completions.create(model="demo-mlp-r16", prompt="Hi", max_tokens=1)  # now in host memory or the pool
    models = _models(openai_server)
    assert set(models) == {BASE, "demo-qv-r4", "demo-all-r8", "demo-mlp-r16", "demo-o-r2"}
    base, adapter = models[BASE].model_dump(), models["demo-mlp-r16"].model_dump()
    assert base["slora"]["kind"] == "base" and base["owned_by"] == "slora" and base["created"] > 0
    assert adapter["parent"] == BASE and adapter["slora"]["kind"] == "adapter"
    assert adapter["slora"]["tier"] in ("host", "gpu") and adapter["slora"]["rank"] == 16
    assert client.models.retrieve(f"{BASE}_lora_demo-qv-r4").id == "demo-qv-r4"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_a_loaded_adapter_appears_and_an_unloaded_one_disappears(openai_server: OpenAIServer) -> None:
    client = openai_server.client()
    adapter_command(openai_server.http_url, "load", "runtime-spare", str(openai_server.spare_adapter))
    try:
        # Each of the server's workers keeps its own list for up to its TTL: read the card from the listing that
        # has it, not from the next one (another worker's, maybe older).
        card = _listing_with(openai_server, "runtime-spare")["runtime-spare"].model_dump()
        assert card["slora"]["tier"] in ("host", "gpu") and card["slora"]["rank"] == 2
        ask = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        spare = client.completions.create(model="runtime-spare", **ask).choices[0].text
        assert spare == client.completions.create(model="demo-o-r2", **ask).choices[0].text  # a copy of it
    finally:
        adapter_command(openai_server.http_url, "unload", "runtime-spare")
    _wait_for(lambda: "runtime-spare" not in _models(openai_server))
    with pytest.raises(openai.NotFoundError, match="runtime-spare"):
        client.completions.create(model="runtime-spare", prompt="Hi", max_tokens=2)


def test_unknown_model_is_404_naming_it(openai_server: OpenAIServer) -> None:
    client = openai_server.client()
    for name in ("no-such-adapter", f"{BASE}_lora_no-such-adapter", "not a valid name"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        error = caught.value.body
        assert caught.value.status_code == 404 and error["code"] == "model_not_found" and error["param"] == "model"
        assert repr(name) in error["message"]


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
        ({"temperature": -1}, "temperature", "greater than or equal to 0"),
        ({"n": 2}, "n", "only n=1 is supported"),
        ({"logprobs": True}, "logprobs", "log probabilities"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"presence_penalty": 0.5}, "presence_penalty", "only 0 is supported"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool calls"),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"bogus": 1}, "bogus", "Unrecognized request argument supplied: bogus"),
    ],
)  # fmt: skip
def test_bad_parameters_are_400_naming_the_field(
    openai_server: OpenAIServer, fields: dict[str, Any], param: str, needle: str
) -> None:
    body = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}
    response = httpx.post(f"{openai_server.openai_url}/chat/completions", json=body, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400, response.text
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert needle in error["message"] and param in error["message"]


def test_bad_messages_and_prompts_name_the_field(openai_server: OpenAIServer) -> None:
    client = openai_server.client()
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content") as caught:
        client.chat.completions.create(model=BASE, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])  # fmt: skip
    assert caught.value.body["param"] == "messages[0].content"
    with pytest.raises(openai.BadRequestError, match="only one prompt per request"):
        client.completions.create(model=BASE, prompt=["a", "b"], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="exceeds the model context"):  # slora's own refusal
        client.completions.create(model=BASE, prompt="Hi", max_tokens=100000)
    response = httpx.post(f"{openai_server.openai_url}/completions", content=b"{not json", timeout=30)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_overload_is_429_with_retry_after(openai_server: OpenAIServer) -> None:
    """More streams than slora runs and queues: the excess is refused at once, 429 with Retry-After."""
    total = MAX_NUM_SEQS + MAX_WAITING + 4
    body = {"model": BASE, "prompt": "Tell me a long story.", "max_tokens": 200, "ignore_eos": True, "stream": True}

    def one(_: int) -> tuple[int, str | None]:
        with httpx.stream("POST", f"{openai_server.openai_url}/completions", json=body, timeout=120) as response:
            if response.status_code == 200:
                next(response.iter_lines())  # generating: leave now, which aborts it
            else:
                response.read()
            return response.status_code, response.headers.get("retry-after")

    with ThreadPoolExecutor(total) as pool:
        results = list(pool.map(one, range(total)))
    refused = [r for r in results if r[0] != 200]
    assert refused and len(refused) < total, results  # how many got in depends on when the engine admitted them
    assert all(status == 429 and retry == "1" for status, retry in refused), results
