"""Model names: the base model and every adapter slora knows, for /v1/models and for reading a request's `model`.

    <base>                      the base model (no adapter)
    <adapter>                   that adapter
    <base><separator><adapter>  that adapter, in the form Triton's OpenAI frontend uses (separator: --lora-separator)

A request's adapter is not checked against the list: slora itself answers for a name it does not know (an adapter
folder added under the root since the last listing still works, one unloaded since then gets 404 at once). The list
behind /v1/models comes from slora's `list` command and is reused for `ttl_s`, so that a client polling the models
does not queue a command to the engine each time; adapters loaded or unloaded at runtime show within `ttl_s`.
Each adapter's `created` is when this server first saw it. Where slora refuses the command (adapter admin off, or a
token this server was not given), only the base model is listed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from slora.backend.serving.openai_api.errors import OpenAIError, from_triton
from slora.backend.serving.openai_api.triton_client import TritonCallError

logger = logging.getLogger(__name__)

_REFUSED = ("adapter commands are disabled", "needs the server's admin token")


@dataclass(frozen=True)
class ModelCard:
    """One entry of /v1/models. `tier`: where the adapter's weights are now (gpu: in the engine's page pool,
    host: in host memory, disk: known only); `rank`: its largest LoRA rank, None until its config is read."""

    id: str
    created: int
    owned_by: str
    parent: str | None = None  # the base model, for adapters
    tier: str | None = None
    rank: int | None = None
    ranks: dict[str, int] | None = None

    def body(self) -> dict[str, Any]:
        slora = {"kind": "adapter" if self.parent else "base", "tier": self.tier, "rank": self.rank,
                 "ranks": self.ranks}  # fmt: skip
        return {"id": self.id, "object": "model", "created": self.created, "owned_by": self.owned_by,
                "parent": self.parent, "slora": slora}  # fmt: skip


class ModelNames:
    """Reads a request's `model`: the adapter it names, or None for the base model."""

    def __init__(self, base: str, separator: str) -> None:
        self.base = base
        self.separator = separator

    def adapter_of(self, model: str) -> str | None:
        if model == self.base:
            return None
        prefix = self.base + self.separator
        if self.separator and model.startswith(prefix) and len(model) > len(prefix):
            return model[len(prefix) :]
        return model


class ModelRegistry:
    """The model cards, from slora's adapter list, reused for `ttl_s` (one refresh at a time)."""

    def __init__(
        self,
        names: ModelNames,
        fetch: Callable[[], Awaitable[dict[str, Any]]],
        owned_by: str,
        ttl_s: float,
        retry_after_s: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._names = names
        self._fetch = fetch
        self._owned_by = owned_by
        self._ttl_s = ttl_s
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._started = int(time.time())
        self._first_seen: dict[str, int] = {}
        self._cards: list[ModelCard] | None = None
        self._fetched_at = float("-inf")
        self._lock = asyncio.Lock()
        self._refusal_logged = False

    async def cards(self) -> list[ModelCard]:
        """The base model first, then every adapter by name; raises OpenAIError (503) if slora cannot answer."""
        async with self._lock:
            if self._cards is None or self._clock() - self._fetched_at >= self._ttl_s:
                self._cards = [self._base_card(), *await self._adapter_cards()]
                self._fetched_at = self._clock()
            return self._cards

    async def card(self, model: str) -> ModelCard | None:
        """The card of `model` (any of its names), or None."""
        adapter = self._names.adapter_of(model)
        for card in await self.cards():
            if card.id == (adapter or self._names.base):
                return card
        return None

    def _base_card(self) -> ModelCard:
        return ModelCard(self._names.base, self._started, self._owned_by)

    async def _adapter_cards(self) -> list[ModelCard]:
        try:
            listing = await self._fetch()
        except TritonCallError as exc:
            if any(phrase in str(exc) for phrase in _REFUSED):
                self._log_refusal(str(exc))
                return []
            raise self._unavailable(exc) from None
        now = int(time.time())
        cards = []
        for row in sorted(listing.get("adapters", []), key=lambda r: str(r.get("name"))):
            name = str(row["name"])
            if name == self._names.base:
                continue  # the base model's name wins (documented): no adapter can be reached under it
            created = self._first_seen.setdefault(name, now)
            cards.append(ModelCard(name, created, self._owned_by, parent=self._names.base, tier=row.get("state"),
                                   rank=row.get("rank"), ranks=row.get("ranks")))  # fmt: skip
        return cards

    def _unavailable(self, exc: TritonCallError) -> OpenAIError:
        error = from_triton(str(exc), self._names.base, self._retry_after_s, exc.reachable)
        if error.status < 500:  # slora refused the list for a reason of its own: still no list to give
            error = OpenAIError(503, str(exc), type="server_error", code="unavailable",
                                retry_after_s=self._retry_after_s)  # fmt: skip
        return error

    def _log_refusal(self, reason: str) -> None:
        if not self._refusal_logged:
            logger.warning("slora refused the adapter list (%s): /v1/models lists the base model only", reason)
            self._refusal_logged = True
