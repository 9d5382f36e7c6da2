"""`--engine-in-stub`: the engine on a thread of Triton's stub, the responder its sink; greedy streams equal the
in-process engine's, a refusal names what is wrong, and the server stops cleanly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slora.backend.engine.sampling_params import SamplingParams
from tests.serving.conftest import MAX_MODEL_LEN, Launched, Server, _stop, launch
from tests.serving.triton_calls import run_one, run_streams, token_inputs

pytestmark = pytest.mark.server

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def in_stub(tmp_path_factory: pytest.TempPathFactory, server: Server) -> Iterator[Launched]:
    root = tmp_path_factory.mktemp("in-stub")
    registry = server.adapter_dir.parent / "multi_lora.json"
    launched = launch(root, "--engine-in-stub", "--adapter-dir", str(server.adapter_dir), "--lora-registry",
                      str(registry), "--max-model-len", str(MAX_MODEL_LEN), "--pool-bytes", "96MiB")  # fmt: skip
    try:
        yield launched
    finally:
        _stop(launched.process, launched.log)


def test_streams_over_adapters_equal_the_engine(in_stub: Launched, server: Server, reference: Any) -> None:
    ids = reference.tokenizer.encode(PROMPT, add_special_tokens=True)
    adapters: list[str | None] = [None, *server.demo_adapters[:3]]
    requests = {f"r{i}": token_inputs(ids, 10, adapter, sampling={"temperature": 0}) for i, adapter in
                enumerate(adapters)}  # fmt: skip
    results = run_streams(in_stub.grpc_url, "slora", requests)
    expected = reference.generate([ids] * len(adapters), adapters, SamplingParams(temperature=0.0, max_tokens=10))
    for i, completion in enumerate(expected):
        got = results[f"r{i}"]
        assert got.error is None and got.final, got
        assert got.token_ids == completion.token_ids, adapters[i]


def test_a_refusal_names_the_adapter(in_stub: Launched) -> None:
    got = run_one(in_stub.grpc_url, "slora", token_inputs([1, 2, 3], 4, "no-such-adapter"))
    assert got.error is not None and "'no-such-adapter'" in got.error, got


def test_the_log_says_where_the_engine_runs(in_stub: Launched) -> None:
    assert "starting the engine in the stub process" in Path(in_stub.log).read_text()
