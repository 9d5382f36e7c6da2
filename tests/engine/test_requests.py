"""Bad requests fail alone with a message naming the problem; the engine and other requests carry on."""

from __future__ import annotations

from pathlib import Path

import pytest

from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.sampling_params import SamplingParams
from slora.backend.errors import AdapterError, AdapterNotFoundError, EngineOverloadedError, InvalidRequestError
from tests.model_fixtures import ModelWithAdapters


@pytest.fixture()
def engine(llama: ModelWithAdapters) -> LLMEngine:
    config = EngineConfig(model=str(llama.base), adapter_root=str(llama.adapter_root), page_size=8,
                          pool_bytes=4 << 20, max_waiting=3, max_model_len=64)  # fmt: skip
    return LLMEngine(config)


@pytest.mark.parametrize(
    ("prompt", "adapter", "sampling", "error", "message"),
    [
        ([], None, None, InvalidRequestError, "prompt is empty"),
        ("text", None, None, InvalidRequestError, "no tokenizer"),
        ([1, 2, 999], None, None, InvalidRequestError, r"token ids must be in \[0, 160\)"),
        ([1, -1], None, None, InvalidRequestError, "token ids"),
        (list(range(60)), None, {"max_tokens": 10}, InvalidRequestError, "exceeds the model context of 64"),
        ([1, 2], "no-such-adapter", None, AdapterNotFoundError, "'no-such-adapter'"),
        ([1, 2], "../r1-qv", None, AdapterError, "invalid"),
        ([1, 2], None, {"max_tokens": 0}, InvalidRequestError, "'max_tokens' must be >= 1"),
        ([1, 2], None, {"stop": ["x"]}, InvalidRequestError, "stop strings need a tokenizer"),
    ],
)
def test_bad_request_refused_and_nothing_queued(
    engine: LLMEngine, prompt: object, adapter: str | None, sampling: dict | None, error: type, message: str
) -> None:
    engine.add_request([1, 2, 3], "r1-qv", SamplingParams(max_tokens=3, temperature=0.0))
    with pytest.raises(error, match=message):
        engine.add_request(prompt, adapter, sampling)  # type: ignore[arg-type]
    assert len(engine.requests) == 1
    while engine.has_unfinished():
        engine.step()
    engine.check_idle_integrity()


def test_waiting_queue_bound(engine: LLMEngine) -> None:
    for _ in range(3):
        engine.add_request([1, 2], None, SamplingParams(max_tokens=2))
    with pytest.raises(EngineOverloadedError, match="max_waiting=3"):
        engine.add_request([1, 2], None, SamplingParams(max_tokens=2))
    engine.step()
    engine.add_request([1, 2], None, SamplingParams(max_tokens=2))  # room again once admitted


def test_duplicate_request_id_refused(engine: LLMEngine) -> None:
    engine.add_request([1, 2], None, None, request_id="same")
    with pytest.raises(InvalidRequestError, match="'same' is already in use"):
        engine.add_request([3, 4], None, None, request_id="same")


def test_bad_config_values_name_the_field(tmp_path: Path) -> None:
    for values, message in [
        ({"page_size": 0}, "page_size"),
        ({"pool_fraction": 1.5}, "pool_fraction"),
        ({"dtype": "float8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"pool_bytes": 10, "pool_fraction": 0.5}, "not both"),
        ({"max_batch_tokens": "lots"}, "max_batch_tokens"),
        ({"no_such_option": 1}, "unknown engine option 'no_such_option'"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig.from_dict(values)
    assert EngineConfig.from_dict({"pool_bytes": "64MiB", "cuda_graphs": "false"}).pool_bytes == 64 << 20
