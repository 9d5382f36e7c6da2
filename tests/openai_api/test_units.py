"""The OpenAI API without a server: request validation, error mapping, model names, the list cache, the slora
request built, SSE events, and the whole app over a fake slora client (FastAPI's TestClient)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from slora.backend.launcher.cli import parse_options
from slora.backend.launcher.openai_frontend import OpenAILaunch, check_openai_port
from slora.backend.serving.openai_api.app import build_app
from slora.backend.serving.openai_api.chat import ChatRenderer
from slora.backend.serving.openai_api.config import OpenAIConfig
from slora.backend.serving.openai_api.errors import OpenAIError, from_triton
from slora.backend.serving.openai_api.models import ModelNames, ModelRegistry
from slora.backend.serving.openai_api.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from slora.backend.serving.openai_api.responses import Head
from slora.backend.serving.openai_api.sampling import chat_request, completion_request
from slora.backend.serving.openai_api.streaming import completion_events
from slora.backend.serving.openai_api.triton_client import SloraPiece, SloraRequest, TritonCallError

BASE = "base-model"


def _parse(schema: type[Any], **fields: Any) -> Any:
    return parse_body(json.dumps(fields).encode(), schema)


def _refusal(schema: type[Any], **fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        _parse(schema, **fields)
    return caught.value


# ---- protocol ---------------------------------------------------------------------------------------------------


def test_fields_are_validated_naming_the_field() -> None:
    chat = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}]}
    cases = {
        "temperature": {**chat, "temperature": 2.01},
        "top_p": {**chat, "top_p": 1.5},
        "seed": {**chat, "seed": -1},
        "n": {**chat, "n": 3},
        "frequency_penalty": {**chat, "frequency_penalty": 1},
        "logit_bias": {**chat, "logit_bias": {"5": 1}},
        "top_logprobs": {**chat, "top_logprobs": 2},
        "response_format": {**chat, "response_format": {"type": "json_object"}},
        "messages[0].role": {**chat, "messages": [{"role": "wizard", "content": "Hi"}]},
        "messages[0].tool_calls": {**chat, "messages": [{"role": "assistant", "content": "", "tool_calls": []}]},
        "messages": {**chat, "messages": []},
        "stop": {**chat, "stop": 5},
        "stop_token_ids": {**chat, "stop_token_ids": [-2]},
        "ttft_slo_s": {**chat, "ttft_slo_s": 0},
        "model": {"messages": chat["messages"]},
    }
    for param, body in cases.items():
        error = _refusal(ChatCompletionRequest, **body)
        assert (error.status, error.param) == (400, param), (param, error.message)
        assert param in error.message


def test_checks_across_fields() -> None:
    chat = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}]}
    assert "differ" in _refusal(ChatCompletionRequest, **chat, max_tokens=3, max_completion_tokens=4).message
    assert _parse(ChatCompletionRequest, **chat, max_tokens=3, max_completion_tokens=3).token_limit == 3
    assert "stream=true" in _refusal(ChatCompletionRequest, **chat, stream_options={"include_usage": True}).message
    assert "token ids" in _refusal(CompletionRequest, model=BASE, prompt=[1, 2], echo=True).message


def test_prompts_and_message_contents() -> None:
    assert _parse(CompletionRequest, model=BASE, prompt=["one"]).prompt == "one"
    assert _parse(CompletionRequest, model=BASE, prompt=[[5, 6]]).prompt == [5, 6]
    assert "one prompt per request" in _refusal(CompletionRequest, model=BASE, prompt=["a", "b"]).message
    assert _refusal(CompletionRequest, model=BASE, prompt="").param == "prompt"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = _parse(ChatCompletionRequest, model=BASE, messages=[{"role": "user", "content": parts}])
    assert request.messages[0].content == "a\nb"
    assert _parse(ChatCompletionRequest, model=BASE, messages=[{"role": "assistant"}]).messages[0].content == ""


def test_body_must_be_a_json_object() -> None:
    for body in (b"{", b"[1]", b"\xff"):
        with pytest.raises(OpenAIError) as caught:
            parse_body(body, CompletionRequest)
        assert caught.value.status == 400


# ---- errors -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "status"),
    [
        ("adapter 'x' is not registered and not found in the adapter root", 404),
        ("adapter name 'a b' is invalid: use 1-128 letters, digits, '_', '.', '-', ...", 404),
        ("3 requests are waiting (max_waiting=2); try again later", 429),
        ("request 'r-1' refused: its first token cannot come within ttft_slo_s=0.5 s: it waited 0.6 s", 429),
        ("request 'r-1' refused: queue_timeout_s=2 s passed while it waited", 429),
        ("the server is shutting down", 503),
        ("request aborted: the model is shutting down", 503),
        ("request failed: the engine process exited unexpectedly (exit code -9); restarting it", 503),
        ("request failed: RuntimeError: boom", 500),
        ("prompt (700 tokens) + max_tokens (16) exceeds the model context of 512 tokens", 400),
    ],
)  # fmt: skip
def test_slora_messages_map_to_statuses(message: str, status: int) -> None:
    error = from_triton(message, "m", retry_after_s=3)
    assert error.status == status
    assert ("Retry-After" in error.headers()) == (status in (429, 503))
    assert error.body()["error"]["message"].endswith(message)
    assert from_triton("Triton: failed to connect", "m", 3, reachable=False).status == 503


# ---- model names and the list cache -------------------------------------------------------------------------


def test_model_names() -> None:
    names = ModelNames(BASE, "_lora_")
    assert names.adapter_of(BASE) is None
    assert names.adapter_of("tuned") == "tuned"
    assert names.adapter_of(f"{BASE}_lora_tuned") == "tuned"
    assert names.adapter_of(f"{BASE}_lora_") == f"{BASE}_lora_"  # no adapter after the separator: a plain name
    assert ModelNames(BASE, "").adapter_of(f"{BASE}_lora_tuned") == f"{BASE}_lora_tuned"


class FakeListing:
    def __init__(self) -> None:
        self.calls = 0
        self.rows: list[dict[str, Any]] = [{"name": "a", "state": "disk", "rank": None, "ranks": None}]
        self.error: TritonCallError | None = None

    async def __call__(self) -> dict[str, Any]:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return {"adapters": list(self.rows), "skipped": []}


def test_registry_reuses_the_list_for_its_ttl() -> None:
    listing, now = FakeListing(), [0.0]
    registry = ModelRegistry(ModelNames(BASE, ":"), listing, "slora", ttl_s=2.0, retry_after_s=1, clock=lambda: now[0])

    def ids() -> list[str]:
        return [card.id for card in asyncio.run(registry.cards())]

    assert ids() == [BASE, "a"]
    listing.rows.append({"name": "b", "state": "host", "rank": 4, "ranks": {"q_proj": 4}})
    assert ids() == [BASE, "a"] and listing.calls == 1
    now[0] = 2.5
    assert ids() == [BASE, "a", "b"] and listing.calls == 2
    card = asyncio.run(registry.card(f"{BASE}:b"))
    assert card is not None and card.body()["slora"] == {"kind": "adapter", "tier": "host", "rank": 4,
                                                         "ranks": {"q_proj": 4}}  # fmt: skip


def test_registry_without_the_list() -> None:
    listing = FakeListing()
    registry = ModelRegistry(ModelNames(BASE, ":"), listing, "slora", ttl_s=0.0, retry_after_s=1)
    listing.error = TritonCallError("adapter commands are disabled on this server (adapter_admin=false)")
    assert [card.id for card in asyncio.run(registry.cards())] == [BASE]
    listing.error = TritonCallError("Triton: failed to connect to all addresses", reachable=False)
    with pytest.raises(OpenAIError) as caught:
        asyncio.run(registry.cards())
    assert caught.value.status == 503


# ---- the slora request ---------------------------------------------------------------------------------------


def test_the_slora_request_of_a_completion_and_a_chat() -> None:
    completion = _parse(CompletionRequest, model=BASE, prompt="Hi", max_tokens=5, temperature=0, stop="x",
                        top_k=3, tenant="team-a", user="u1")  # fmt: skip
    got = completion_request(completion, "cmpl-1", None)
    sampling = {"temperature": 0.0, "top_k": 3, "stop": ["x"], "max_tokens": 5}
    parameters = {"apply_chat_template": False, "add_special_tokens": True, "tenant": "team-a"}
    assert got == SloraRequest("cmpl-1", "Hi", None, sampling, False, parameters)
    chat = _parse(ChatCompletionRequest, model="tuned", messages=[{"role": "user", "content": "Hi"}], stream=True,
                  max_completion_tokens=7, seed=3, priority=2)  # fmt: skip
    got = chat_request(chat, "chatcmpl-1", "tuned", "<rendered>")
    assert (got.prompt, got.adapter, got.stream) == ("<rendered>", "tuned", True)
    assert got.sampling == {"seed": 3, "max_tokens": 7}
    assert got.parameters == {"apply_chat_template": False, "add_special_tokens": False, "priority": 2}


def test_responses_are_read_from_their_raw_contents() -> None:
    import numpy as np
    from tritonclient.grpc import InferResult, service_pb2
    from tritonclient.utils import serialize_byte_tensor

    from slora.backend.serving.openai_api.triton_client import _piece

    response = service_pb2.ModelInferResponse(model_name="slora", id="r")
    outputs = {"text_output": ("BYTES", serialize_byte_tensor(np.array(["¡olé".encode()], dtype=object)).item()),
               "finish_reason": ("BYTES", serialize_byte_tensor(np.array([b"stop"], dtype=object)).item()),
               "num_input_tokens": ("UINT32", np.array([12], dtype=np.uint32).tobytes()),
               "num_output_tokens": ("UINT32", np.array([3], dtype=np.uint32).tobytes())}  # fmt: skip
    for name, (dtype, raw) in outputs.items():
        response.outputs.add(name=name, datatype=dtype, shape=[1])
        response.raw_output_contents.append(raw)
    assert _piece(InferResult(response)) == SloraPiece("¡olé", 12, 3, "stop")


# ---- SSE events --------------------------------------------------------------------------------------------------


async def _pieces(*pieces: SloraPiece | TritonCallError) -> AsyncIterator[SloraPiece]:
    for piece in pieces:
        if isinstance(piece, TritonCallError):
            raise piece
        yield piece


def _events(pieces: Any, include_usage: bool, echo: str = "") -> list[Any]:
    async def collect() -> list[str]:
        to_error = lambda exc: from_triton(str(exc), "m", 1)  # noqa: E731
        return [e async for e in completion_events(pieces, Head("cmpl-1", "m", 1), include_usage, to_error, echo)]

    events = asyncio.run(collect())
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_completion_events() -> None:
    pieces = _pieces(SloraPiece("He", 4, 1, ""), SloraPiece("llo", 4, 2, "length"))
    first, second, usage = _events(pieces, include_usage=True, echo="")
    assert [first["choices"][0]["text"], second["choices"][0]["text"]] == ["He", "llo"]
    assert [first["choices"][0]["finish_reason"], second["choices"][0]["finish_reason"]] == [None, "length"]
    assert first["usage"] is None and usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    echo, text = _events(_pieces(SloraPiece("!", 1, 1, "stop")), include_usage=False, echo="Hi")
    assert (echo["choices"][0]["text"], text["choices"][0]["text"]) == ("Hi", "!") and "usage" not in echo
    _, error = _events(_pieces(SloraPiece("a", 1, 1, ""), TritonCallError("request failed: boom")), True)
    assert error["error"]["type"] == "server_error" and "boom" in error["error"]["message"]


# ---- the app over a fake slora client -------------------------------------------------------------------------


class FakeSlora:
    """Answers like slora: `script` maps a prompt to its pieces (or an error)."""

    script: dict[str, list[SloraPiece | TritonCallError]] = {}
    seen: list[SloraRequest] = []

    def __init__(self, url: str, model: str, admin_token: str | None) -> None:
        self.admin_token = admin_token

    async def generate(self, request: SloraRequest) -> AsyncIterator[SloraPiece]:
        FakeSlora.seen.append(request)
        for piece in FakeSlora.script[str(request.prompt)]:
            if isinstance(piece, TritonCallError):
                raise piece
            yield piece

    async def adapters(self) -> dict[str, Any]:
        return {"adapters": [{"name": "tuned", "state": "gpu", "rank": 8, "ranks": {"q_proj": 8}}]}

    async def ready(self) -> bool:
        return True

    async def close(self) -> None:
        return None


class FakeTokenizer:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages: list[dict[str, str]], **options: Any) -> str:
        return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"


@pytest.fixture
def app_client() -> Any:
    FakeSlora.script = {
        "Hi": [SloraPiece(" there", 2, 2, "stop")],
        "user:Hi|assistant:": [SloraPiece("Hel", 5, 1, ""), SloraPiece("lo", 5, 1, "length")],
        "full": [TritonCallError("4 requests are waiting (max_waiting=2); try again later")],
        "later": [SloraPiece("a", 1, 1, ""), TritonCallError("request failed: boom")],
    }
    FakeSlora.seen = []
    app = build_app(OpenAIConfig(retry_after_s=2), BASE, ChatRenderer(FakeTokenizer()), client_factory=FakeSlora)
    with TestClient(app) as client:
        yield client


def test_app_routes(app_client: Any) -> None:
    models = app_client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [BASE, "tuned"] and models["object"] == "list"
    assert app_client.get(f"/v1/models/{BASE}_lora_tuned").json()["slora"]["rank"] == 8
    assert app_client.get("/v1/models/other").status_code == 404
    whole = app_client.post("/v1/completions", json={"model": "tuned", "prompt": "Hi", "echo": True}).json()
    assert whole["choices"][0]["text"] == "Hi there" and whole["usage"]["total_tokens"] == 4
    assert FakeSlora.seen[-1].adapter == "tuned"
    hello = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}]}
    chat = app_client.post("/v1/chat/completions", json=hello)
    assert chat.json()["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert FakeSlora.seen[-1].adapter is None and FakeSlora.seen[-1].parameters["add_special_tokens"] is False
    assert app_client.get("/health").json() == {"ready": True}
    missing = app_client.get("/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()


def test_app_errors_before_and_after_a_stream_began(app_client: Any) -> None:
    refused = app_client.post("/v1/completions", json={"model": BASE, "prompt": "full", "stream": True})
    assert refused.status_code == 429 and refused.headers["retry-after"] == "2"
    assert refused.json()["error"]["code"] == "overloaded"
    with app_client.stream("POST", "/v1/completions", json={"model": BASE, "prompt": "later", "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert json.loads(lines[0][6:])["choices"][0]["text"] == "a"
    assert "boom" in json.loads(lines[1][6:])["error"]["message"] and lines[-1] == "data: [DONE]"
    chat = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    with app_client.stream("POST", "/v1/chat/completions", json=chat) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"] for e in events[1:]] == [{"content": "Hel"}, {"content": "lo"}]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


# ---- the launcher --------------------------------------------------------------------------------------------


def test_launcher_options() -> None:
    options = parse_options(["--openai-port", "9100", "--grpc-port", "9001", "--openai-arg=--lora-separator=:"])
    launch = OpenAILaunch(options.openai_port or 0, options.host, options.grpc_port, options.model,
                          extra_args=options.openai_args)  # fmt: skip
    command = launch.command()
    assert command[command.index("--triton-url") + 1] == "127.0.0.1:9001"
    assert command[command.index("--port") + 1] == "9100" and command[-1] == "--lora-separator=:"
    assert "--admin-token-file" not in command
    guarded = OpenAILaunch(9100, "0.0.0.0", 9001, "default", tokenizer="/tok", admin_token_file="/token").command()
    assert guarded[guarded.index("--admin-token-file") + 1] == "/token" and "/tok" in guarded
    assert parse_options([]).openai_port is None
    with pytest.raises(ValueError, match="taken by another endpoint"):
        parse_options(["--openai-port", "8001"])
    with pytest.raises(ValueError, match="1..65535"):
        check_openai_port(0, {})
