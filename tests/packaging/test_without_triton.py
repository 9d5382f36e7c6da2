"""`pip install .[serve]` without the `kernels` extra: no triton package, and still the engine and the server run.

Each test runs a process in which `import triton` fails as it does when the package is missing (no_triton.py), so
CI proves it without a second environment: every module of the engine imports, the CPU engine generates the greedy
tokens of the normal path, kernel_backend=triton says which extra it needs, and slora-serve starts and serves.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

from slora.backend.config import EngineConfig
from slora.backend.engine.llm_engine import LLMEngine
from slora.backend.engine.sampling_params import SamplingParams
from tests.model_fixtures import ModelWithAdapters
from tests.packaging.no_triton import run_without_triton

MAX_TOKENS = 6
PROMPTS = [[5, 9, 14, 2, 7], [3] * 20, [11, 12], [8, 1, 4]]


def _json_result(root: Path, *args: str) -> dict[str, Any]:
    done = run_without_triton(root, "-m", "tests.packaging.without_triton_main", *args)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_triton_is_blocked(tmp_path: Path) -> None:
    done = run_without_triton(tmp_path, "-c", "import triton")
    assert done.returncode != 0 and "ModuleNotFoundError: No module named 'triton'" in done.stderr


def test_every_engine_module_imports_without_triton(tmp_path: Path) -> None:
    """Every module of slora.backend, slora.client and slora.kernels but the Triton-language kernels imports, unless
    it needs a module that this environment lacks as well: Triton's stub module (triton_python_backend_utils,
    inside the server alone) for the Triton glue, or another extra's package (fastapi for the OpenAI server)."""
    result = _json_result(tmp_path, "imports")
    for module, failure in result["failed"].items():
        missing = (failure["missing"] or "").split(".")[0]
        assert missing and missing != "triton", f"{module}: {failure['error']}"
        assert importlib.util.find_spec(missing) is None, f"{module} fails without triton: {failure['error']}"
    assert result["modules"] > 60 and not result["triton_loaded"]


def _config(model: ModelWithAdapters) -> dict[str, Any]:
    return {"model": str(model.base), "adapter_root": str(model.adapter_root), "device": "cpu", "dtype": "float32",
            "page_size": 8, "pool_bytes": 4 << 20, "max_num_seqs": 8, "max_model_len": 128}  # fmt: skip


def test_the_cpu_engine_without_triton_generates_the_normal_paths_tokens(
    llama: ModelWithAdapters, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy tokens of every adapter and the base model in one batch, with triton blocked, equal those of this
    process (triton installed); kernel_backend=triton is refused naming the extra that installs it."""
    adapters: list[str | None] = [None, *llama.adapters]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(adapters))]
    job = {"config": _config(llama), "prompts": prompts, "adapters": adapters, "max_tokens": MAX_TOKENS}
    (tmp_path / "job.json").write_text(json.dumps(job))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # so that kernel_backend=triton on CPU gets as far as the kernels
    result = _json_result(tmp_path, "generate", str(tmp_path / "job.json"))
    engine = LLMEngine(EngineConfig.from_dict(job["config"]))
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    assert result["tokens"] == [c.token_ids for c in engine.generate(prompts, adapters, greedy)]
    assert result["ops"] == "torch" and not result["triton_loaded"]
    assert "kernel_backend='triton' needs the triton package" in result["triton_error"]
    assert "pip install 'slora-triton[kernels]'" in result["triton_error"]


@pytest.mark.server
def test_slora_serve_without_triton_serves_the_engines_tokens(
    default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """slora-serve (the launcher, Triton's stub with the slora model, the engine process) with triton blocked in
    every process starts, and streams the greedy tokens of an in-process engine for a demo adapter and the base."""
    from slora.backend.adapters.demo import write_demo_adapters
    from tests.packaging.no_triton import blocked_environment
    from tests.serving.conftest import _stop, launch
    from tests.serving.triton_calls import run_streams, token_inputs

    adapters = tmp_path / "adapters"
    write_demo_adapters("default", adapters)
    for name, value in blocked_environment(tmp_path).items():
        if os.environ.get(name) != value:
            monkeypatch.setenv(name, value)
    server = launch(tmp_path, "--adapter-dir", str(adapters), "--max-model-len", "256", "--pool-bytes", "64MiB")
    try:
        reference = LLMEngine(EngineConfig(model="default", device="cpu", adapter_root=str(adapters),
                                           max_model_len=256, pool_bytes=64 << 20))  # fmt: skip
        names: list[str | None] = [None, sorted(p.name for p in adapters.iterdir())[0]]
        ids = [reference.tokenizer.encode("The capital of France is"), reference.tokenizer.encode("Hello!")]
        requests = {f"r{i}": token_inputs(ids[i], max_tokens=MAX_TOKENS, adapter=a, sampling={"temperature": 0})
                    for i, a in enumerate(names)}  # fmt: skip
        served = run_streams(server.grpc_url, "slora", requests)
        expected = reference.generate(ids, names, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        for i, completion in enumerate(expected):
            got = served[f"r{i}"]
            assert got.error is None and got.final, got.error
            assert got.token_ids == completion.token_ids, names[i]
        assert "ModuleNotFoundError" not in server.log.read_text()
    finally:
        _stop(server.process, server.log)
