"""Incremental detokenization with stop strings: the one place where generated tokens become text.

Text is produced the way TGI and vLLM do it: decode a small window of ids before and after the newest token and
keep the difference, holding text back while the window ends inside a multi-byte character (U+FFFD). Characters
that could be the start of a stop string are held back too, so that streamed deltas concatenate to exactly the
final text, which ends before the stop string. Servers send these deltas as they are; nothing decodes again.
"""

from __future__ import annotations

from typing import Any

CONTEXT_TOKENS = 5  # prompt tokens decoded with the first output token, so its leading space is right


class IncrementalDetokenizer:
    """Per-request text state. `update` after each new token; `take` returns what may be sent now."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._prefix = max(len(prompt_ids) - CONTEXT_TOKENS, 0)
        self._read = len(prompt_ids)
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    def update(self, ids: list[int]) -> None:
        """Fold in the tokens of `ids` past the last read offset; sets `stopped` when a stop string appears."""
        prefix_text = self._decode(ids[self._prefix : self._read])
        full_text = self._decode(ids[self._prefix :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return
        before = len(self.text)
        self.text += full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(ids)
        self._find_stop(before)

    def _find_stop(self, before: int) -> None:
        if not self._stop:
            return
        search_from = max(0, before - self._holdback)
        hits = [i for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def take(self, final: bool) -> str:
        """The text that may be sent now (all of it when `final`); marks it as sent."""
        limit = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - self._holdback)
        if limit <= self.sent:
            return ""
        delta = self.text[self.sent : limit]
        self.sent = limit
        return delta
