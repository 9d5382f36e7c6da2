"""The base model's tokenizer: loaded from a folder when it holds tokenizer files, else absent (token ids only)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load_tokenizer(path: str | Path) -> Any | None:
    """The Hugging Face tokenizer of folder `path`, or None when it holds no tokenizer files."""
    path = Path(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
