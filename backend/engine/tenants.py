"""Tenants: who a request is served for, each tenant's weight, and the tokens served to each.

A request's tenant is its `tenant` argument when given, else its adapter's name, else BASE_TENANT (the base model
is a tenant too). One customer may own several adapters and name itself in each request. Weights (default 1.0)
scale a tenant's share under the `fair` policy; they come from EngineConfig.tenant_weights_file, a JSON object
{"tenant": weight, ...}, and may be changed at runtime (LLMEngine.set_tenant_weights).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slora.backend.errors import InvalidRequestError

if TYPE_CHECKING:  # request.py imports this module
    from slora.backend.engine.request import Request

# Angle brackets are not allowed in adapter or tenant names, so no adapter's tenant can be the base model's.
BASE_TENANT = "<base>"
DEFAULT_WEIGHT = 1.0
MAX_WEIGHT = 1e6
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-:@]{0,127}$")  # adapter names, plus ':' and '@' (org:user, a@b)


def check_tenant(tenant: object) -> str:
    """`tenant` as given by a request; raises InvalidRequestError naming the field."""
    if isinstance(tenant, str) and (tenant == BASE_TENANT or _NAME.fullmatch(tenant)):
        return tenant
    raise InvalidRequestError(
        f"tenant {tenant!r} is invalid: use 1-128 letters, digits, '_', '.', '-', ':', '@', not starting with "
        f"a punctuation mark, or {BASE_TENANT!r} for the base model's"
    )


def tenant_of(tenant: str | None, adapter: str | None) -> str:
    """The tenant a request is served for (see the module docstring)."""
    if tenant is not None:
        return check_tenant(tenant)
    return adapter if adapter is not None else BASE_TENANT


def check_weights(weights: object, source: str = "tenant weights") -> dict[str, float]:
    """{tenant: weight} with every name valid and every weight a finite number in (0, MAX_WEIGHT]; raises
    InvalidRequestError (a ValueError) naming `source`, the tenant and the bad value."""
    if not isinstance(weights, Mapping):
        raise InvalidRequestError(f"{source} must be an object of tenant: weight, got {type(weights).__name__}")
    out: dict[str, float] = {}
    for tenant, weight in weights.items():
        try:
            name = check_tenant(tenant)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{source}: {exc}") from None
        # `not 0 < weight <= MAX_WEIGHT` also refuses NaN and infinity
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= MAX_WEIGHT:
            raise InvalidRequestError(
                f"{source}: the weight of tenant {name!r} must be a number in (0, {MAX_WEIGHT:g}], got {weight!r}"
            )
        out[name] = float(weight)
    return out


def load_weights_file(path: str | Path) -> dict[str, float]:
    """EngineConfig.tenant_weights_file: a JSON object {"tenant": weight}; ValueError naming the field and file."""
    source = f"tenant_weights_file {str(path)!r}"
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"{source} cannot be read: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not JSON: {exc}") from None
    return check_weights(data, source)


@dataclass
class TenantUsage:
    """Tokens served to one tenant by requests that left the engine (finished, aborted or refused)."""

    prompt_tokens: int = 0
    output_tokens: int = 0


def served_tokens(request: Request) -> tuple[int, int]:
    """(prompt, output) tokens served to `request` so far; a recomputation after preemption counts once."""
    prompt = request.num_prompt if request.num_output else min(request.num_computed, request.num_prompt)
    return prompt, request.num_output


class TenantBook:
    """Every tenant's weight and the tokens served to it; what the `fair` policy and the statistics read.

    Usage is counted when a request leaves (no work per step); statistics add the requests still in the engine.
    Tenants with nothing queued or running are dropped once more than MAX_IDLE_TENANTS are known (their usage
    starts again from zero), so that a flood of one-off tenant names cannot grow the engine's memory for ever.
    """

    MAX_IDLE_TENANTS = 4096

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self.weights: dict[str, float] = dict(weights or {})
        self.usage: dict[str, TenantUsage] = {}

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, DEFAULT_WEIGHT)

    def set_weights(self, weights: Mapping[str, float], replace: bool = False) -> dict[str, float]:
        """Merge (or with `replace`, replace) the weights; all are checked before any is set. Returns them all."""
        checked = check_weights(weights)
        if replace:
            self.weights = checked
        else:
            self.weights.update(checked)
        return dict(self.weights)

    def finished(self, request: Request) -> None:
        prompt, output = served_tokens(request)
        usage = self.usage.get(request.tenant)
        if usage is None:
            usage = self.usage[request.tenant] = TenantUsage()
        usage.prompt_tokens += prompt
        usage.output_tokens += output

    def forget_idle(self, busy: Iterable[str]) -> None:
        """Drop the usage of tenants not in `busy` once more than MAX_IDLE_TENANTS are known."""
        if len(self.usage) <= self.MAX_IDLE_TENANTS:
            return
        keep = set(busy)
        self.usage = {t: u for t, u in self.usage.items() if t in keep}
