"""Chat messages → one prompt text, through the tokenizer's chat template, in the OpenAI server's process.

The whole conversation is rendered here, with the generation prompt, and sent to slora as `text_input` with
`add_special_tokens=false` (the template writes its own special tokens) and `apply_chat_template=false`, so that
slora tokenizes it once, as it is. The tokenizer is the model folder's (or --tokenizer's), loaded the way slora
loads it (backend/model/tokenizer.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from slora.backend.model.tokenizer import load_tokenizer
from slora.backend.serving.openai_api.errors import bad_request
from slora.backend.serving.openai_api.protocol import ChatMessage

logger = logging.getLogger(__name__)


class ChatRenderer:
    def __init__(self, tokenizer: Any | None) -> None:
        self._tokenizer = tokenizer

    @classmethod
    def from_folder(cls, path: str | Path) -> ChatRenderer:
        tokenizer = load_tokenizer(path)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            logger.warning("%s has no chat template: /v1/chat/completions will refuse requests", path)
        return cls(tokenizer)

    def render(self, messages: list[ChatMessage]) -> str:
        """The prompt text of `messages`, ending with the assistant's turn; raises OpenAIError (400) when the model
        has no chat template or the template refuses the conversation (its message says why)."""
        if self._tokenizer is None or not getattr(self._tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template: use /v1/completions with your own prompt", "messages")
        conversation = [_message(m) for m in messages]
        try:
            text = self._tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # jinja2's TemplateError, or raise_exception() of the template itself
            raise bad_request(f"the chat template refused the messages: {exc}", "messages") from None
        return str(text)


def _message(message: ChatMessage) -> dict[str, str]:
    rendered = {"role": message.role, "content": message.content}
    if message.name:
        rendered["name"] = message.name
    return rendered
