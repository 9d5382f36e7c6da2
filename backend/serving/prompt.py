"""Text prompts → token ids, once, in the server: plain text, the model's chat template, and what to echo.

`PromptEncoder` tokenizes the way the engine does for a text prompt, so that a served text request and an
in-process `LLMEngine` given the same string see the same ids; with the chat template, the prompt becomes one user
message and the template's own special tokens are kept as rendered (no extra BOS). A server whose checkpoint has
no tokenizer files still serves token ids; its text requests are refused with a message that says how to fix it.

`exclude_input_in_output` follows Triton's vLLM backend: not given means "exclude" when streaming and "include"
otherwise; including the prompt in a streamed output is refused.
"""

from __future__ import annotations

from typing import Any

from slora.backend.errors import InvalidRequestError

NO_TOKENIZER = (
    "this server has no tokenizer (the checkpoint folder holds no tokenizer files), so it serves token ids "
    "(input_ids) only: start slora-serve with --tokenizer PATH to serve text"
)


class PromptEncoder:
    def __init__(self, tokenizer: Any | None, chat_template: bool = False) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template  # the default of requests that do not say

    def encode(self, text: str, chat_template: bool | None = None, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, optionally rendered as a user message of the model's chat template."""
        if self.tokenizer is None:
            raise InvalidRequestError(NO_TOKENIZER)
        if not text:
            raise InvalidRequestError("the prompt (text_input) is empty")
        if self.chat_template if chat_template is None else chat_template:
            if not getattr(self.tokenizer, "chat_template", None):
                raise InvalidRequestError(
                    "apply_chat_template was asked for, but this model's tokenizer has no chat template"
                )
            rendered = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            return list(self.tokenizer.encode(rendered, add_special_tokens=False))
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))


def prompt_echo(text: str, stream: bool, exclude_input_in_output: bool | None) -> str:
    """What to put before the generated text: the prompt, or nothing."""
    include = not exclude_input_in_output if exclude_input_in_output is not None else not stream
    if include and stream:
        raise InvalidRequestError("exclude_input_in_output=false is not supported with stream=true")
    return text if include else ""


def parse_flag(value: Any, name: str) -> bool:
    """A boolean request parameter, also sent as the strings 'true'/'false'."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise InvalidRequestError(f"request parameter {name!r} must be a boolean, got {value!r}")
