"""The text ends of the ensemble, without Triton: prompt → token ids (preprocessing), spans → text (postprocessing).

Both are stateless. Preprocessing tokenizes the way the engine does for a text prompt, so that the ensemble and an
in-process `LLMEngine` given the same string see the same ids; with the chat template, the prompt becomes one user
message and the template's own special tokens are kept as rendered (no extra BOS).

`exclude_input_in_output` follows Triton's vLLM backend: not given means "exclude" when streaming and "include"
otherwise; including the prompt in a streamed output is refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from slora.backend.errors import InvalidRequestError


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def encode_prompt(tokenizer: Any, text: str, chat_template: bool) -> np.ndarray:
    """INT32 [num_tokens] ids of `text`, optionally wrapped in the model's chat template as a user message."""
    if not text:
        raise InvalidRequestError("the prompt (text_input) is empty")
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "apply_chat_template was asked for, but this model's tokenizer has no chat template"
            )
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer.encode(rendered, add_special_tokens=False)
    else:
        ids = tokenizer.encode(text, add_special_tokens=True)
    return np.asarray(ids, dtype=np.int32)


def prompt_prefix(text: str, stream: bool, exclude_input_in_output: bool | None) -> str:
    """What to put before the generated text: the prompt, or nothing."""
    include = not exclude_input_in_output if exclude_input_in_output is not None else not stream
    if include and stream:
        raise InvalidRequestError("exclude_input_in_output=false is not supported with stream=true")
    return text if include else ""


def decode_spans(tokenizer: Any, span_ids: np.ndarray, spans: np.ndarray) -> str:
    """The text of a response from its spans (see response_stream.py): decode each window, cut its range."""
    pieces = []
    offset = 0
    for num_ids, start, length in spans.reshape(-1, 3).tolist():
        ids = span_ids[offset : offset + num_ids].tolist()
        offset += num_ids
        pieces.append(str(tokenizer.decode(ids, skip_special_tokens=True))[start : start + length])
    if offset != span_ids.size:
        raise InvalidRequestError(f"text_spans cover {offset} ids, but text_span_ids holds {span_ids.size}")
    return "".join(pieces)


def parse_flag(value: Any, name: str) -> bool:
    """A boolean request parameter, also sent as the strings 'true'/'false'."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise InvalidRequestError(f"request parameter {name!r} must be a boolean, got {value!r}")
